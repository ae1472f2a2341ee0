//! The real `openai` Python client against `router-host serve` (completions and chat, streamed
//! and not). Skipped, with the reason printed, only when python3 or the package cannot be had;
//! the client is installed into a venv under ~/.cache, outside the repository.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::engine::{workers_yaml, Engine, TestRouter};

const SCRIPT: &str = r#"
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0, timeout=30)
out = {}
r = client.completions.create(model="tiny", prompt="hello world", max_tokens=3)
out["completion"] = r.choices[0].text
raw = client.completions.with_raw_response.create(model="tiny", prompt="hello", max_tokens=3)
out["worker_header"] = raw.headers.get("x-router-worker")
chunks = list(client.completions.create(model="tiny", prompt="hello", stream=True,
                                        stream_options={"include_usage": True}))
out["stream_text"] = "".join(c.choices[0].text for c in chunks if c.choices)
out["stream_usage"] = chunks[-1].usage.completion_tokens
c = client.chat.completions.create(model="tiny",
                                   messages=[{"role": "user", "content": "hello"}])
out["chat"] = c.choices[0].message.content
s = client.chat.completions.create(model="tiny", stream=True,
                                   messages=[{"role": "user", "content": "hello"}])
out["chat_stream"] = "".join(x.choices[0].delta.content or "" for x in s if x.choices)
out["models"] = [m.id for m in client.models.list()]
try:
    client.completions.create(model="tiny", prompt=[1, -1])
except Exception as e:
    out["bad_status"] = getattr(e, "status_code", None)
print(json.dumps(out))
"#;

/// A python with `openai` importable, or why there is none.
fn python_with_openai() -> Result<PathBuf, String> {
    common::venv::installed("router-host-openai-venv", &["openai"], "python", |python| {
        Command::new(python)
            .args(["-c", "import openai"])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_works_through_the_router() {
    let python = match tokio::task::spawn_blocking(python_with_openai)
        .await
        .unwrap()
    {
        Ok(python) => python,
        // CI sets ROUTER_REQUIRE_OPENAI_CLIENT (.ci/run installs what the client needs): there,
        // a missing client fails the test instead of skipping it.
        Err(reason) if std::env::var_os("ROUTER_REQUIRE_OPENAI_CLIENT").is_some() => {
            panic!("the openai Python client is required here: {reason}")
        }
        Err(reason) => {
            println!("skipped: the openai Python client is not available here: {reason}");
            return;
        }
    };
    let (e1, e2) = (Engine::start(1).await, Engine::start(2).await);
    // Idle engines tie; the lowest row takes the tie, so the first answer names worker 1.
    let yaml = format!(
        "block_size: 4\ndefault_selector: {{tie_break: lowest_row}}\n{}",
        workers_yaml(&[&e1, &e2])
    );
    let router = TestRouter::start("serve_openai", &yaml).await;
    let base = format!("http://{}", router.addr);
    let output = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .args(["-c", SCRIPT, &base])
            .env_remove("OPENAI_BASE_URL")
            .env_remove("OPENAI_API_KEY")
            .output()
            .expect("run python")
    })
    .await
    .unwrap();
    assert!(
        output.status.success(),
        "the client failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let out: serde_json::Value = serde_json::from_slice(&output.stdout).expect("the script's JSON");
    assert_eq!(out["completion"], " tok0 tok1 tok2");
    assert_eq!(out["worker_header"], "1");
    assert_eq!(out["stream_text"], " tok0 tok1 tok2");
    assert_eq!(out["stream_usage"], 3);
    assert_eq!(out["chat"], " tok0 tok1 tok2");
    assert_eq!(out["chat_stream"], " tok0 tok1 tok2");
    assert_eq!(out["models"], serde_json::json!(["tiny"]));
    assert_eq!(out["bad_status"], 400);
    assert_eq!(router.in_flight(), (0, 0));
    router.stop().await;
}
