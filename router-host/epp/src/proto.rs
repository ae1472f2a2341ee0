//! Envoy's ext_proc v3 messages as the picker reads and writes them (envoy-types' prost code),
//! re-exported for tests and tools that drive the picker as Envoy does.

use std::collections::HashMap;

pub use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as EnvoyHeaderMap, HeaderValue as EnvoyHeaderValue, HeaderValueOption, Metadata,
};
pub use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
pub use envoy_types::pb::envoy::service::ext_proc::v3 as ext_proc;
pub use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
/// A gRPC connection for such a client.
pub use tonic::transport::Channel;
/// The answers of one stream as a client (a test acting as Envoy) reads them.
pub use tonic::Streaming;
/// The gRPC health service's messages and client (`grpc.health.v1`).
pub use tonic_health::pb as health;

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use ext_proc::{
    body_mutation, common_response, processing_response, BodyMutation, BodyResponse,
    CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse, ProcessingResponse,
    StreamedBodyResponse, TrailersResponse,
};
use router_runtime::ApiError;

/// The metadata namespace of the picked endpoint (request: `envoy.lb`).
pub const DESTINATION_NAMESPACE: &str = "envoy.lb";
/// The header and metadata key of the picked endpoint.
pub const DESTINATION_KEY: &str = "x-gateway-destination-endpoint";
/// The metadata key (in [`DESTINATION_NAMESPACE`] of the response messages'
/// `metadata_context`) under which the data plane reports the endpoint that served.
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// The metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The metadata key of the subset hint.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The header that says why the picker refused a request (the error's code).
pub const REJECTED_REASON: &str = "x-router-rejected-reason";

/// A header as Envoy sends it: `raw_value` (bytes) when set, else `value`.
pub fn header_bytes(header: &EnvoyHeaderValue) -> &[u8] {
    if header.raw_value.is_empty() {
        header.value.as_bytes()
    } else {
        &header.raw_value
    }
}

/// A header to set, overwriting any of the same name.
pub fn set_header(key: &str, value: &[u8]) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(EnvoyHeaderValue {
            key: key.to_owned(),
            value: String::new(),
            raw_value: value.to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

fn string_value(text: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(text.to_owned())),
    }
}

/// `dynamic_metadata` naming the picked endpoint: `envoy.lb: {x-gateway-destination-endpoint}`.
pub fn destination_metadata(endpoint: &str) -> Struct {
    let inner = Struct {
        fields: HashMap::from([(DESTINATION_KEY.to_owned(), string_value(endpoint))]),
    };
    Struct {
        fields: HashMap::from([(
            DESTINATION_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]),
    }
}

/// The endpoints of the subset hint in `metadata`, if the hint is there: a list of `ip:port`
/// strings (a comma-separated string is read too).
pub fn subset_hint(metadata: &Metadata) -> Option<Vec<String>> {
    let hint = metadata.filter_metadata.get(SUBSET_NAMESPACE)?;
    let value = hint.fields.get(SUBSET_KEY)?;
    let mut endpoints = Vec::new();
    match &value.kind {
        Some(Kind::ListValue(list)) => {
            for item in &list.values {
                if let Some(Kind::StringValue(text)) = &item.kind {
                    endpoints.extend(split_endpoints(text));
                }
            }
        }
        Some(Kind::StringValue(text)) => endpoints.extend(split_endpoints(text)),
        _ => {}
    }
    Some(endpoints)
}

/// The endpoint the data plane reports serving the response (`envoy.lb:
/// {x-gateway-destination-endpoint-served: ip:port}` in `metadata_context`), if it says;
/// a value that is not a string reads as `""`, which names no worker.
pub fn served_endpoint(metadata: &Metadata) -> Option<String> {
    let lb = metadata.filter_metadata.get(DESTINATION_NAMESPACE)?;
    match &lb.fields.get(SERVED_KEY)?.kind {
        Some(Kind::StringValue(text)) => Some(text.trim().to_owned()),
        _ => Some(String::new()),
    }
}

fn split_endpoints(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

/// Continue, with these mutations. A request-path header mutation (the destination) also asks
/// Envoy to choose the route again: a route that matches on the destination header (the
/// fail-open configuration in docs/gateway.md) was chosen before the picker answered, and
/// without this Envoy keeps it, sending the request past the pick.
fn common(
    request: bool,
    header_mutation: Option<HeaderMutation>,
    body: Option<BodyMutation>,
) -> CommonResponse {
    CommonResponse {
        status: common_response::ResponseStatus::Continue as i32,
        clear_route_cache: request && header_mutation.is_some(),
        header_mutation,
        body_mutation: body,
        ..CommonResponse::default()
    }
}

fn response(response: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..ProcessingResponse::default()
    }
}

/// Continue the request headers, with `headers` set.
pub fn request_headers(headers: Vec<HeaderValueOption>) -> ProcessingResponse {
    response(processing_response::Response::RequestHeaders(
        HeadersResponse {
            response: Some(common(true, mutation(headers), None)),
        },
    ))
}

/// Continue the response headers, with `headers` set.
pub fn response_headers(headers: Vec<HeaderValueOption>) -> ProcessingResponse {
    response(processing_response::Response::ResponseHeaders(
        HeadersResponse {
            response: Some(common(false, mutation(headers), None)),
        },
    ))
}

fn mutation(headers: Vec<HeaderValueOption>) -> Option<HeaderMutation> {
    (!headers.is_empty()).then(|| HeaderMutation {
        set_headers: headers,
        remove_headers: Vec::new(),
    })
}

/// How a body chunk is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkAnswer {
    /// Continue: the chunk goes on as Envoy holds it (`BUFFERED`, `STREAMED`).
    Continue,
    /// Sent back as a streamed body mutation (`FULL_DUPLEX_STREAMED`: Envoy forwards only what
    /// the processor sends back).
    Echo,
}

/// The answer to one body chunk; `request` says which direction; `headers` set (only when the
/// headers are still held: `BUFFERED`, or a chunk answered before the headers were sent).
pub fn body_chunk(
    request: bool,
    how: ChunkAnswer,
    chunk: &[u8],
    end_of_stream: bool,
    headers: Vec<HeaderValueOption>,
) -> ProcessingResponse {
    let body = match how {
        ChunkAnswer::Continue => None,
        ChunkAnswer::Echo => Some(BodyMutation {
            mutation: Some(body_mutation::Mutation::StreamedResponse(
                StreamedBodyResponse {
                    body: chunk.to_vec(),
                    end_of_stream,
                    ..StreamedBodyResponse::default()
                },
            )),
        }),
    };
    let answer = BodyResponse {
        response: Some(common(request, mutation(headers), body)),
    };
    response(if request {
        processing_response::Response::RequestBody(answer)
    } else {
        processing_response::Response::ResponseBody(answer)
    })
}

/// Trailers passed on unchanged.
pub fn trailers(request: bool) -> ProcessingResponse {
    let answer = TrailersResponse::default();
    response(if request {
        processing_response::Response::RequestTrailers(answer)
    } else {
        processing_response::Response::ResponseTrailers(answer)
    })
}

/// The client's answer for a refused request: the error's status and OpenAI-style JSON body,
/// `retry-after` when it has one, and its code in `x-router-rejected-reason`.
pub fn refusal(err: &ApiError) -> ProcessingResponse {
    let mut headers = vec![
        set_header("content-type", b"application/json"),
        set_header(REJECTED_REASON, err.code.as_bytes()),
    ];
    if let Some(secs) = err.retry_after_secs() {
        headers.push(set_header("retry-after", secs.to_string().as_bytes()));
    }
    response(processing_response::Response::ImmediateResponse(
        ImmediateResponse {
            status: Some(envoy_types::pb::envoy::r#type::v3::HttpStatus {
                code: i32::from(err.status.as_u16()),
            }),
            headers: mutation(headers),
            body: err.body().to_string().into_bytes(),
            details: format!("router_{}", err.code),
            ..ImmediateResponse::default()
        },
    ))
}
