//! One ext_proc stream = one HTTP request through Envoy. The request phase reads the headers
//! and the body as the filter sends it, runs the pipeline's `prepare` and `legs::route`, and
//! answers with the picked endpoint (header and `envoy.lb` metadata) or an immediate refusal.
//! The response phase drives the leg's [`Flight`]: first byte, end, failure; the stream's end
//! before that drops it (cancelled). Every request-phase answer keeps the protocol's order:
//! the headers' answer, then one answer per body chunk, then the trailers'.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures_util::Stream;
use hyper::http::{HeaderMap, HeaderName, HeaderValue};
use plugin_api::abi::CompletionCode;
use plugin_api::RowId;
use router_core::model::Request as CoreRequest;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

use router_runtime::errors::ApiError;
use router_runtime::lifecycle::Flight;
use router_runtime::pipeline::{self, Inbound};
use router_runtime::prompt::Endpoint;
use router_runtime::{request, App, LoadedConfig};

use crate::proto::ext_proc::external_processor_server::ExternalProcessor;
use crate::proto::ext_proc::{
    processing_request, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use crate::proto::{self, BodySendMode, ChunkAnswer, HeaderValueOption};

/// Answers queued per stream before the stream's task waits for Envoy to read them.
const ANSWERS_QUEUED: usize = 16;
/// The most request headers read from one stream.
const MAX_HEADERS: usize = 256;

/// The ext_proc service: one task per stream.
#[derive(Clone)]
pub struct Picker {
    pub app: Arc<App>,
}

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let inbound = request.into_inner();
        let (tx, mut rx) = mpsc::channel(ANSWERS_QUEUED);
        let app = self.app.clone();
        tokio::spawn(async move {
            let mut stream = Exchange {
                app,
                inbound,
                tx,
                request_mode: None,
                response_mode: BodySendMode::None,
                hold_headers: true,
            };
            stream.run().await;
        });
        let answers = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
        Ok(Response::new(Box::pin(answers)))
    }
}

/// Why a stream ended.
enum Gone {
    /// Envoy closed the stream: it has nothing more to send.
    Closed,
    /// The stream failed or was reset (client gone, timeout), or our answers have no reader.
    Reset,
}

/// The request phase's outcome.
struct Picked {
    flight: Flight,
    loaded: Arc<LoadedConfig>,
    rebook: Rebook,
}

/// What moving the booking to the endpoint that served needs.
struct Rebook {
    /// The picked endpoint (`ip:port`), first in the destination.
    destination: String,
    /// The request as the core routed it (blocks, lengths), pinned anew when moved.
    request: CoreRequest,
    endpoint: Endpoint,
    received: Instant,
}

/// How the route ended: the booking, the destination to name (the picked endpoint, then
/// the fallbacks) and what a move needs.
struct Routed {
    flight: Flight,
    destination: String,
    rebook: Rebook,
}

struct Exchange {
    app: Arc<App>,
    inbound: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    /// The request body mode the filter said (`protocol_config`); `None` before it did.
    request_mode: Option<BodySendMode>,
    response_mode: BodySendMode,
    /// Whether the request headers' answer waits for the body (it carries the destination).
    hold_headers: bool,
}

/// The request as read so far.
#[derive(Default)]
struct Reading {
    endpoint: Option<Endpoint>,
    headers: HeaderMap,
    subset: Option<Vec<String>>,
    /// The chunks as received, each answered in order once the pick is made.
    chunks: Vec<Bytes>,
    /// Chunks already answered (headers not held: each answered as it came).
    answered: usize,
    seen: u64,
    trailers: bool,
}

impl Exchange {
    async fn send(&self, answer: ProcessingResponse) -> Result<(), Gone> {
        self.tx.send(Ok(answer)).await.map_err(|_| Gone::Reset)
    }

    async fn next(&mut self) -> Result<ProcessingRequest, Gone> {
        match self.inbound.message().await {
            Ok(Some(message)) => {
                if let Some(config) = &message.protocol_config {
                    self.configure(config);
                }
                Ok(message)
            }
            Ok(None) => Err(Gone::Closed),
            Err(_) => Err(Gone::Reset),
        }
    }

    fn configure(&mut self, config: &proto::ext_proc::ProtocolConfiguration) {
        if self.request_mode.is_some() {
            return;
        }
        let mode = BodySendMode::try_from(config.request_body_mode).unwrap_or(BodySendMode::None);
        self.request_mode = Some(mode);
        self.response_mode =
            BodySendMode::try_from(config.response_body_mode).unwrap_or(BodySendMode::None);
        self.hold_headers = match mode {
            BodySendMode::FullDuplexStreamed => true,
            BodySendMode::Streamed => config.send_body_without_waiting_for_header_response,
            _ => false,
        };
    }

    /// The request mode; a filter that did not say is taken as GIE's `FULL_DUPLEX_STREAMED`.
    fn request_mode(&self) -> BodySendMode {
        self.request_mode
            .unwrap_or(BodySendMode::FullDuplexStreamed)
    }

    fn chunk_answer(mode: BodySendMode) -> ChunkAnswer {
        if mode == BodySendMode::FullDuplexStreamed {
            ChunkAnswer::Echo
        } else {
            ChunkAnswer::Continue
        }
    }

    async fn run(&mut self) {
        let received = Instant::now();
        let loaded = self.app.current.load();
        let limit = loaded.serve.timeouts.body_read;
        let read = tokio::time::timeout(limit, self.read_request(&loaded)).await;
        let picked = match read {
            Err(_elapsed) => {
                self.app.metrics.client_timeout("body");
                self.refuse(None, ApiError::body_timeout(limit)).await;
                return;
            }
            Ok(Err(_gone)) => return,
            Ok(Ok((reading, Err(err)))) => {
                self.refuse(reading.endpoint, err).await;
                return;
            }
            Ok(Ok((reading, Ok(())))) => self.pick(reading, loaded, received).await,
        };
        if let Some(picked) = picked {
            self.response_phase(picked).await;
        }
    }

    /// Read the headers and the body to its end (answering what must be answered as it
    /// comes); `Err` inside for a request refused before the pick.
    async fn read_request(
        &mut self,
        loaded: &LoadedConfig,
    ) -> Result<(Reading, Result<(), ApiError>), Gone> {
        let mut reading = Reading::default();
        let max = loaded.serve.max_body_bytes;
        loop {
            let message = self.next().await?;
            if reading.subset.is_none() {
                reading.subset = message
                    .metadata_context
                    .as_ref()
                    .and_then(proto::subset_hint);
            }
            match message.request {
                Some(processing_request::Request::RequestHeaders(headers)) => {
                    if let Err(err) = self.read_headers(&mut reading, &headers) {
                        return Ok((reading, Err(err)));
                    }
                    if headers.end_of_stream {
                        return Ok((
                            reading,
                            Err(ApiError::bad_request(
                                "missing_body",
                                "the request has no body; a completion is a JSON body",
                            )),
                        ));
                    }
                    if self.request_mode() == BodySendMode::None {
                        return Ok((
                            reading,
                            Err(ApiError::internal(
                                "the ext_proc filter sends no request body \
                                 (processing_mode.request_body_mode NONE): the picker needs \
                                 FULL_DUPLEX_STREAMED, BUFFERED or STREAMED",
                            )),
                        ));
                    }
                    if !self.hold_headers {
                        self.send(proto::request_headers(Vec::new())).await?;
                    }
                }
                Some(processing_request::Request::RequestBody(body)) => {
                    if reading.endpoint.is_none() {
                        return Ok((
                            reading,
                            Err(out_of_order("a request body before the request headers")),
                        ));
                    }
                    reading.seen = reading.seen.saturating_add(body.body.len() as u64);
                    if reading.seen > max {
                        return Ok((reading, Err(ApiError::too_large(max))));
                    }
                    reading.chunks.push(Bytes::from(body.body));
                    if body.end_of_stream {
                        return Ok((reading, Ok(())));
                    }
                    if !self.hold_headers {
                        // Answered as it comes, but the last one: it carries the destination.
                        let mode = self.request_mode();
                        let last = reading.chunks.len() - 1;
                        self.send(proto::body_chunk(
                            true,
                            Self::chunk_answer(mode),
                            &reading.chunks[last],
                            false,
                            Vec::new(),
                        ))
                        .await?;
                        reading.answered = reading.chunks.len();
                    }
                }
                Some(processing_request::Request::RequestTrailers(_)) => {
                    if reading.endpoint.is_none() {
                        return Ok((
                            reading,
                            Err(out_of_order("request trailers before the request headers")),
                        ));
                    }
                    reading.trailers = true;
                    return Ok((reading, Ok(())));
                }
                Some(_) => {
                    return Ok((
                        reading,
                        Err(out_of_order(
                            "a response message before the request was answered",
                        )),
                    ))
                }
                None => {}
            }
        }
    }

    fn read_headers(
        &mut self,
        reading: &mut Reading,
        headers: &HttpHeaders,
    ) -> Result<(), ApiError> {
        let mut path = None;
        let mut method = None;
        let list = headers
            .headers
            .as_ref()
            .map(|h| h.headers.as_slice())
            .unwrap_or_default();
        if list.len() > MAX_HEADERS {
            return Err(ApiError::bad_request(
                "too_many_headers",
                format!("the request has {} headers, over {MAX_HEADERS}", list.len()),
            ));
        }
        for header in list {
            let value = proto::header_bytes(header);
            match header.key.as_str() {
                ":path" => path = Some(String::from_utf8_lossy(value).into_owned()),
                ":method" => method = Some(String::from_utf8_lossy(value).into_owned()),
                key if key.starts_with(':') => {}
                key => {
                    // A header no HTTP client could send is not one the session can come from.
                    if let (Ok(name), Ok(value)) = (
                        HeaderName::from_bytes(key.as_bytes()),
                        HeaderValue::from_bytes(value),
                    ) {
                        reading.headers.append(name, value);
                    }
                }
            }
        }
        let path = path.unwrap_or_default();
        let route = path.split('?').next().unwrap_or_default();
        let endpoint = match route {
            "/v1/completions" => Endpoint::Completions,
            "/v1/chat/completions" => Endpoint::ChatCompletions,
            _ => {
                return Err(ApiError {
                    status: hyper::http::StatusCode::NOT_FOUND,
                    ..ApiError::bad_request(
                        "not_found",
                        format!(
                            "the picker routes POST /v1/completions and POST \
                             /v1/chat/completions, not `{}`",
                            excerpt(route)
                        ),
                    )
                })
            }
        };
        reading.endpoint = Some(endpoint);
        if method.as_deref().is_some_and(|m| m != "POST") {
            return Err(ApiError {
                status: hyper::http::StatusCode::METHOD_NOT_ALLOWED,
                ..ApiError::bad_request("method_not_allowed", "a completion is a POST")
            });
        }
        Ok(())
    }

    /// Parse, prepare and route; answer with the destination (or refuse).
    async fn pick(
        &mut self,
        reading: Reading,
        loaded: Arc<LoadedConfig>,
        received: Instant,
    ) -> Option<Picked> {
        let endpoint = reading.endpoint.unwrap_or(Endpoint::Completions);
        let routed = self.route(&reading, &loaded, endpoint, received).await;
        let Routed {
            flight,
            destination,
            rebook,
        } = match routed {
            Ok(routed) => routed,
            Err(err) => {
                self.refuse(Some(endpoint), err).await;
                return None;
            }
        };
        let headers = vec![proto::set_header(
            proto::DESTINATION_KEY,
            destination.as_bytes(),
        )];
        let metadata = proto::destination_metadata(&destination);
        let mode = self.request_mode();
        let how = Self::chunk_answer(mode);
        let mut answers = Vec::new();
        let last = reading.chunks.len().saturating_sub(1);
        if self.hold_headers {
            let mut answer = proto::request_headers(headers);
            answer.dynamic_metadata = Some(metadata);
            answers.push(answer);
            for (i, chunk) in reading.chunks.iter().enumerate() {
                let end = i == last && !reading.trailers;
                answers.push(proto::body_chunk(true, how, chunk, end, Vec::new()));
            }
        } else {
            // The headers went on already: the destination rides on the last chunk's answer
            // (`BUFFERED` holds the headers until then).
            for (i, chunk) in reading.chunks.iter().enumerate().skip(reading.answered) {
                let end = i == last && !reading.trailers;
                let mut answer = if i == last {
                    proto::body_chunk(true, how, chunk, end, headers.clone())
                } else {
                    proto::body_chunk(true, how, chunk, end, Vec::new())
                };
                if i == last {
                    answer.dynamic_metadata = Some(metadata.clone());
                }
                answers.push(answer);
            }
        }
        if reading.trailers {
            answers.push(proto::trailers(true));
        }
        for answer in answers {
            if self.send(answer).await.is_err() {
                // Envoy is gone: the flight drops here, cancelled.
                return None;
            }
        }
        Some(Picked {
            flight,
            loaded,
            rebook,
        })
    }

    async fn route(
        &self,
        reading: &Reading,
        loaded: &Arc<LoadedConfig>,
        endpoint: Endpoint,
        received: Instant,
    ) -> Result<Routed, ApiError> {
        let mut body = Vec::with_capacity(usize::try_from(reading.seen).unwrap_or(0));
        for chunk in &reading.chunks {
            body.extend_from_slice(chunk);
        }
        let parsed = request::parse(endpoint, &body)?;
        let session = request::session_id(&reading.headers, &parsed.body, &loaded.serve)?;
        let allowed = match &reading.subset {
            None => None,
            Some(subset) => {
                let ids: Vec<u64> = loaded
                    .upstreams
                    .iter()
                    .filter(|u| host_port(&u.base).is_some_and(|hp| subset.contains(&hp)))
                    .map(|u| u.id)
                    .collect();
                if ids.is_empty() {
                    return Err(ApiError::unavailable(
                        "no_endpoint_in_subset",
                        format!(
                            "none of the {} endpoints of the subset hint ({SUBSET}) is a \
                             configured worker",
                            subset.len(),
                            SUBSET = proto::SUBSET_KEY
                        ),
                    ));
                }
                Some(ids)
            }
        };
        let inbound = Inbound {
            endpoint,
            parsed,
            body: Bytes::from(body),
            session,
            headers: reading.headers.clone(),
            received,
        };
        let prepared = pipeline::prepare(&self.app, loaded, &inbound.parsed)
            .await
            .map_err(|err| err.into_api_error(endpoint))?;
        let leg = pipeline::legs::route(
            &self.app,
            loaded,
            &inbound,
            &prepared,
            allowed.clone(),
            pipeline::legs::LegKind::First,
        )
        .await?;
        let Some(picked) = host_port(&leg.upstream.base) else {
            let worker = leg.upstream.id;
            leg.flight.release_uncounted(CompletionCode::FAILED);
            return Err(ApiError::internal(format!(
                "worker {worker}'s URL has no host:port to name as the destination"
            )));
        };
        let wanted = loaded.config.epp.as_ref().map_or(0, |epp| epp.fallbacks);
        let mut destination = picked.clone();
        for fallback in self.fallbacks(loaded, allowed.as_deref(), leg.upstream.id, wanted) {
            destination.push(',');
            destination.push_str(&fallback);
        }
        let request = CoreRequest {
            blocks: prepared.blocks.clone(),
            isl_tokens: prepared.isl_tokens,
            expected_output_tokens: prepared.expected_output_tokens,
            ..CoreRequest::default()
        };
        Ok(Routed {
            flight: leg.flight,
            destination,
            rebook: Rebook {
                destination: picked,
                request,
                endpoint,
                received,
            },
        })
    }

    /// Up to `wanted` fallback endpoints after `picked`: the other workers of the subset (all,
    /// without a hint) that are healthy and not draining, the least loaded first (fewest
    /// requests booked on their rows, then fewest prefill tokens; then file order). Policies
    /// rank only their pick, so this is the router's load order, not the policy's.
    fn fallbacks(
        &self,
        loaded: &LoadedConfig,
        allowed: Option<&[u64]>,
        picked: u64,
        wanted: usize,
    ) -> Vec<String> {
        if wanted == 0 {
            return Vec::new();
        }
        let load = loaded.host.load();
        let allowed: Option<std::collections::HashSet<u64>> =
            allowed.map(|ids| ids.iter().copied().collect());
        let mut candidates: Vec<((u64, u64), usize, String)> = loaded
            .config
            .workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.id != picked && !w.draining)
            .filter(|(_, w)| allowed.as_ref().is_none_or(|ids| ids.contains(&w.id)))
            .filter(|(_, w)| self.app.health.is_healthy(w.id))
            .filter_map(|(order, w)| {
                let endpoint = host_port(&loaded.upstream(w.id)?.base)?;
                let busy = (0..w.dp_size)
                    .map(|rank| {
                        load.get(RowId {
                            worker_id: w.id,
                            dp_rank: rank,
                        })
                    })
                    .fold((0u64, 0u64), |(r, p), row| {
                        (
                            r.saturating_add(row.active_requests),
                            p.saturating_add(row.active_prefill_tokens),
                        )
                    });
                Some((busy, order, endpoint))
            })
            .collect();
        candidates.sort_unstable_by_key(|(busy, order, _)| (*busy, *order));
        candidates
            .into_iter()
            .take(wanted)
            .map(|(_, _, endpoint)| endpoint)
            .collect()
    }

    /// The data plane reports `served` served the response: when that is another worker than
    /// the booked one, book the request there (pinned, without admission: the engine has it
    /// already) and release the old booking; a `served` no worker has, or a row that cannot
    /// be booked, keeps the booking. Counted in `router_epp_served_elsewhere{outcome}`.
    async fn served_by(
        &self,
        flight: Flight,
        loaded: &Arc<LoadedConfig>,
        rebook: &Rebook,
        served: &str,
    ) -> Flight {
        let booked = flight.info.row.worker_id;
        if served == rebook.destination {
            return flight;
        }
        let metrics = &self.app.metrics;
        let worker = loaded
            .upstreams
            .iter()
            .find(|u| host_port(&u.base).as_deref() == Some(served))
            .map(|u| u.id);
        let Some(worker) = worker else {
            metrics.epp_served_elsewhere("unknown_endpoint");
            tracing::debug!(
                served = %excerpt(served),
                booked,
                "the data plane reports a served endpoint no worker has; the booking stays"
            );
            return flight;
        };
        if worker == booked {
            return flight;
        }
        let request = CoreRequest {
            pinned_worker: Some(RowId {
                worker_id: worker,
                dp_rank: 0,
            }),
            ..rebook.request.clone()
        };
        let core = loaded.host.core();
        let routed = self
            .app
            .decider
            .decide(loaded, || core.route_indexed(&request, false))
            .await;
        match routed {
            Ok(routed) => {
                let mut info = flight.info.clone();
                info.row = routed.decision.row;
                let moved = Flight::new(
                    self.app.clone(),
                    loaded.clone(),
                    &routed,
                    info,
                    rebook.endpoint.label(),
                    rebook.received,
                );
                // Not the request's end: the moved booking ends it, counted once.
                flight.release_uncounted(CompletionCode::FAILED);
                metrics.epp_served_elsewhere("moved");
                tracing::debug!(
                    from = booked,
                    to = worker,
                    served,
                    "served by another endpoint than the picked one; the booking moved to it"
                );
                moved
            }
            Err(err) => {
                metrics.epp_served_elsewhere("not_moved");
                tracing::debug!(
                    booked,
                    served = worker,
                    error = %err,
                    "served by another endpoint than the picked one, which cannot be booked; \
                     the booking stays"
                );
                flight
            }
        }
    }

    async fn refuse(&mut self, endpoint: Option<Endpoint>, err: ApiError) {
        if let Some(endpoint) = endpoint {
            self.app.metrics.request(endpoint.label(), err.outcome());
        }
        tracing::info!(
            endpoint = endpoint.map_or("-", Endpoint::label),
            status = err.status.as_u16(),
            code = err.code,
            error = %err.message,
            "request refused"
        );
        let _ = self.send(proto::refusal(&err)).await;
    }

    /// The response: first byte at its first body chunk (or its headers when it has no body),
    /// completed at its end, failed on a 5xx; the stream's end before that cancels.
    async fn response_phase(&mut self, picked: Picked) {
        let Picked {
            mut flight,
            loaded,
            rebook,
        } = picked;
        let decision = |flight: &Flight| {
            let mut headers = HeaderMap::new();
            if loaded.serve.decision_headers {
                pipeline::decision_headers(&mut headers, &flight.info, loaded.number);
            }
            headers
                .iter()
                .map(|(name, value)| proto::set_header(name.as_str(), value.as_bytes()))
                .collect::<Vec<HeaderValueOption>>()
        };
        let mut served_read = false;
        let mut failed = false;
        let mut headers_seen = false;
        loop {
            let message = match self.next().await {
                Ok(message) => message,
                // Without the response body the picker sees no end of the response: Envoy
                // ends the stream (a reset, as Envoy 1.40 does it) once the response headers
                // are processed, so their answer is the end.
                Err(_) if headers_seen && self.response_mode == BodySendMode::None => {
                    return finish(flight, failed);
                }
                // Before the response's end: the client went away (or the stream was reset, or
                // response processing is off): dropped, the flight cancels.
                Err(_) => return,
            };
            if !served_read {
                let served = message
                    .metadata_context
                    .as_ref()
                    .and_then(proto::served_endpoint);
                if let Some(served) = served {
                    served_read = true;
                    flight = self.served_by(flight, &loaded, &rebook, &served).await;
                }
            }
            match message.request {
                Some(processing_request::Request::ResponseHeaders(headers)) => {
                    failed = response_status(&headers).is_some_and(|s| s >= 500);
                    headers_seen = true;
                    if self.response_mode == BodySendMode::None {
                        // No body will be seen: the headers are the first byte.
                        flight.first_byte();
                    }
                    let answer = proto::response_headers(decision(&flight));
                    if headers.end_of_stream {
                        let _ = self.send(answer).await;
                        return finish(flight, failed);
                    }
                    if self.send(answer).await.is_err() {
                        return;
                    }
                }
                Some(processing_request::Request::ResponseBody(body)) => {
                    flight.first_byte();
                    let how = Self::chunk_answer(self.response_mode);
                    let answer =
                        proto::body_chunk(false, how, &body.body, body.end_of_stream, Vec::new());
                    if body.end_of_stream {
                        let _ = self.send(answer).await;
                        return finish(flight, failed);
                    }
                    if self.send(answer).await.is_err() {
                        return;
                    }
                }
                Some(processing_request::Request::ResponseTrailers(_)) => {
                    let _ = self.send(proto::trailers(false)).await;
                    return finish(flight, failed);
                }
                Some(_) | None => {
                    let _ = self
                        .tx
                        .send(Err(Status::invalid_argument(
                            "a request-phase message after the request was answered",
                        )))
                        .await;
                    return;
                }
            }
        }
    }
}

fn finish(mut flight: Flight, failed: bool) {
    if failed {
        flight.finish(CompletionCode::FAILED, "failed");
    } else {
        flight.first_byte();
        flight.finish(CompletionCode::COMPLETED, "completed");
    }
}

fn response_status(headers: &HttpHeaders) -> Option<u16> {
    let list = headers.headers.as_ref()?;
    let status = list.headers.iter().find(|h| h.key == ":status")?;
    std::str::from_utf8(proto::header_bytes(status))
        .ok()?
        .parse()
        .ok()
}

fn out_of_order(what: &str) -> ApiError {
    ApiError::bad_request(
        "ext_proc_protocol",
        format!("the ext_proc stream sent {what}"),
    )
}

fn excerpt(text: &str) -> String {
    text.chars().take(64).collect()
}

/// `host:port` of a worker's base URL (`http://10.0.0.5:8000` -> `10.0.0.5:8000`), with the
/// scheme's port when the URL names none.
pub fn host_port(base: &str) -> Option<String> {
    let uri: hyper::http::Uri = base.parse().ok()?;
    let authority = uri.authority()?;
    let port = authority.port_u16().or(match uri.scheme_str() {
        Some("https") => Some(443),
        Some("http") => Some(80),
        _ => None,
    })?;
    Some(format!("{}:{port}", authority.host()))
}
