"""``--kv-transfer-config`` and ``kv_transfer_params`` validation, and the pull protocol against a producer
that misbehaves (unknown request, another model's fingerprint, a damaged payload)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import zmq

from kvserve.config import EngineConfig
from kvserve.disagg.config import KVTransferConfig
from kvserve.disagg.protocol import (
    DECODER,
    ENCODER,
    Pull,
    PullReply,
    RemotePrefill,
    TransferError,
    checksum,
    parse_transfer_params,
    pull_blocks,
    release_remote,
)
from kvserve.entrypoints.cli import build_parser
from kvserve.errors import InvalidRequestError


def test_vllm_spelling_is_parsed() -> None:
    cfg = KVTransferConfig.from_value('{"kv_connector": "ZmqConnector", "kv_role": "kv_consumer", '
                                      '"kv_ip": "127.0.0.1", "kv_port": 15000}')
    assert cfg == KVTransferConfig("ZmqConnector", "kv_consumer", "127.0.0.1", 15000, 30.0, "")
    assert cfg is not None and cfg.is_consumer and not cfg.is_producer
    args = build_parser().parse_args(["serve", "--kv-transfer-config", '{"kv_role": "kv_producer"}'])
    assert EngineConfig.from_cli_args(args).kv_transfer == KVTransferConfig(kv_role="kv_producer")


@pytest.mark.parametrize("value, match", [
    ("{", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ({"kv_buffer_size": 1e9}, "unsupported key 'kv_buffer_size'"),
    ({"kv_connector": "NixlConnector"}, "kv_connector 'NixlConnector' is not available"),
    ({"kv_role": "producer"}, "kv_role 'producer' must be one of"),
    ({"kv_ip": "localhost"}, "kv_ip 'localhost' is not an IP address"),
    ({"kv_port": 70000}, "kv_port 70000"),
    ({"kv_port": True}, "kv_port True"),
    ({"kv_transfer_timeout_s": 0}, "kv_transfer_timeout_s 0"),
    ({"kv_connector_extra_config": {"a": 1}}, "takes no extra config"),
])
def test_bad_configs_are_refused_naming_the_key(value: Any, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match) as e:
        EngineConfig(kv_transfer_config=value)
    assert e.value.param == "kv_transfer_config"


_GOOD = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5, "remote_request_id": "r",
         "remote_engine_id": "e", "num_prompt_tokens": 3, "first_token_ids": [9]}


@pytest.mark.parametrize("change, match", [
    ({"remote_port": "5"}, "remote_port has the wrong type"),
    ({"first_token_ids": []}, "first_token_ids must be a non-empty list"),
    ({"first_token_ids": [True]}, "first_token_ids must be a non-empty list"),
    ({"num_prompt_tokens": 0}, "out of range"),
    ({"extra": 1}, "unsupported key 'extra'"),
])
def test_bad_transfer_params(change: dict[str, Any], match: str) -> None:
    assert parse_transfer_params(_GOOD) == RemotePrefill("127.0.0.1", 5, "r", "e", 3, [9])
    with pytest.raises(InvalidRequestError, match=match):
        parse_transfer_params({**_GOOD, **change})
    bad = dict(_GOOD)
    del bad["remote_host"]
    with pytest.raises(InvalidRequestError, match="remote_host is missing"):
        parse_transfer_params(bad)


def _fake_producer(replies: list[list[bytes]]) -> tuple[int, threading.Thread, list[Any]]:
    """A ROUTER answering each request with the next canned reply; records what it got."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    seen: list[Any] = []

    def run() -> None:
        for reply in replies:
            ident, msg = sock.recv_multipart()
            seen.append(DECODER.decode(msg))
            sock.send_multipart([ident, *reply])
        sock.close(linger=0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return port, t, seen


def _params(port: int) -> RemotePrefill:
    return RemotePrefill("127.0.0.1", port, "req-1", "e", 20, [1])


def test_pull_checks_status_and_checksums() -> None:
    payload = b"\x01" * 64
    ok = PullReply("ok", 20, 1, [b"h"], "float32", [1, 2, 2, 2, 2], 64, "xxh3_64", [checksum(payload)])
    damaged = PullReply("ok", 20, 1, [b"h"], "float32", [1, 2, 2, 2, 2], 64, "xxh3_64", [checksum(payload) + 1])
    port, t, seen = _fake_producer([[ENCODER.encode(PullReply("unknown"))], [ENCODER.encode(damaged), payload],
                                    [ENCODER.encode(ok), payload]])
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    with pytest.raises(TransferError) as e:
        pull_blocks(ctx, _params(port), 1, "fp", 5.0)
    assert e.value.kind == "unknown"
    with pytest.raises(TransferError) as e:
        pull_blocks(ctx, _params(port), 1, "fp", 5.0)
    assert e.value.kind == "checksum"
    reply, payloads = pull_blocks(ctx, _params(port), 1, "fp", 5.0)
    assert reply.first_block == 1 and payloads == [payload]
    t.join(5)
    assert seen == [Pull("req-1", 1, "fp")] * 3


def test_pull_and_release_time_out_on_a_silent_producer() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")  # bound, never answers
    try:
        with pytest.raises(TransferError) as e:
            pull_blocks(ctx, _params(port), 0, "fp", 0.2)
        assert e.value.kind == "timeout"
        assert release_remote(ctx, "127.0.0.1", port, "req-1", timeout_s=0.2) is False
    finally:
        sock.close(linger=0)
