"""What moves between a prefill (P) instance, a decode (D) instance and the proxy. Torch-free.

Request parameters (``kv_transfer_params`` in a completion or chat request body, vLLM's field):

- to P: ``{"do_remote_decode": true}``: keep the prompt's KV blocks after the request finishes by length
  (the proxy sends ``max_tokens: 1``), until a decode instance confirms it has them (or a timeout). P's
  response carries ``kv_transfer_params`` = :class:`RemotePrefill` as a dict, or null when there is
  nothing to continue (the request stopped: EOS, a stop string).
- to D: that dict as P returned it: ``{"do_remote_prefill": true, "remote_host", "remote_port",
  "remote_request_id", "remote_engine_id", "num_prompt_tokens", "first_token_ids"}``. D pulls the prompt's
  KV from P, takes ``first_token_ids`` (what P sampled, already streamed to the client) as its first output
  tokens, and continues from there: D computes none of the prompt, and its output (text, logprobs) starts
  after those tokens while ``usage.completion_tokens`` and ``max_tokens`` count them.

The transfer (ZMQ DEALER at D -> ROUTER at P's ``kv_ip:kv_port``; msgpack headers by msgspec, raw bytes
after; never pickle):

    D: [Pull{request_id, first_block, fingerprint}]
    P: [PullReply{status, num_tokens, first_block, block_hashes, dtype, block_shape, block_nbytes,
                  checksum_algo, checksums}, block payload, block payload, ...]
    D: [Release{request_id}]        (P frees the pinned blocks; also sent by the proxy for a P result it
    P: [Released{found}]             does not continue, e.g. after a client disconnect)

A block payload is one block of every layer, ``[num_layers, 2 (K, V), block_size, kv_heads, head_dim]`` in
the cache dtype (``ModelRunner.export_blocks``); the prompt's last block is sent even when partial.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from typing import Any

import msgspec
import zmq

from kvserve.errors import InvalidRequestError
from kvserve.kv_offload.format import CHECKSUM_ALGO, checksum

__all__ = ["Pull", "PullReply", "Release", "Released", "RemoteDecode", "RemotePrefill", "TransferError",
           "parse_transfer_params", "pull_blocks", "release_remote", "CHECKSUM_ALGO", "checksum"]


class Pull(msgspec.Struct, tag="pull", forbid_unknown_fields=True):
    request_id: str  # P's request id (``remote_request_id``)
    first_block: int  # the first block D needs (the blocks before it hit D's prefix cache)
    fingerprint: str  # D's model fingerprint: P refuses KV of another model


class Release(msgspec.Struct, tag="release", forbid_unknown_fields=True):
    request_id: str


class PullReply(msgspec.Struct, tag="pull_reply", forbid_unknown_fields=True):
    status: str  # "ok" | "unknown" (no such pinned request: freed, timed out) | "fingerprint" | "range"
    num_tokens: int = 0  # prompt tokens whose KV P holds (the last block may be partial)
    first_block: int = 0
    block_hashes: list[bytes] = []  # P's hash chain of the full blocks sent (D checks it against its own)
    dtype: str = ""
    block_shape: list[int] = []
    block_nbytes: int = 0
    checksum_algo: str = CHECKSUM_ALGO
    checksums: list[int] = []  # one per payload frame


class Released(msgspec.Struct, tag="released", forbid_unknown_fields=True):
    found: bool


Message = Pull | Release | PullReply | Released
ENCODER = msgspec.msgpack.Encoder()
DECODER: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


class TransferError(Exception):
    """A pull that delivered no usable KV; ``kind`` labels the failures metric."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclass(frozen=True)
class RemoteDecode:
    """P side: keep this request's prompt KV for a decode instance."""


@dataclass(frozen=True)
class RemotePrefill:
    """D side (and P's answer): where the prompt's KV is and what P already sampled."""

    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_engine_id: str
    num_prompt_tokens: int
    first_token_ids: list[int]
    do_remote_prefill: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_transfer_params(value: Any) -> RemoteDecode | RemotePrefill | None:
    """A request's ``kv_transfer_params`` (None, or a JSON object as described in the module docstring).

    Raises:
        InvalidRequestError: not an object, both or neither of ``do_remote_decode`` / ``do_remote_prefill``,
            a missing or mistyped key (the message names it; ``param`` is ``kv_transfer_params``).
    """
    if value is None:
        return None

    def bad(msg: str) -> InvalidRequestError:
        return InvalidRequestError(f"kv_transfer_params: {msg}", param="kv_transfer_params")

    if not isinstance(value, dict):
        raise bad("must be an object")
    decode, prefill = bool(value.get("do_remote_decode")), bool(value.get("do_remote_prefill"))
    if decode == prefill:
        raise bad("set exactly one of do_remote_decode (to a prefill instance) and do_remote_prefill "
                  "(to a decode instance)")
    if decode:
        unknown = sorted(set(value) - {"do_remote_decode", "do_remote_prefill"})
        if unknown:
            raise bad(f"unsupported key {unknown[0]!r} with do_remote_decode")
        return RemoteDecode()
    types: dict[str, type | tuple[type, ...]] = {
        "remote_host": str, "remote_port": int, "remote_request_id": str, "remote_engine_id": str,
        "num_prompt_tokens": int, "first_token_ids": list}
    unknown = sorted(set(value) - set(types) - {"do_remote_prefill", "do_remote_decode"})
    if unknown:
        raise bad(f"unsupported key {unknown[0]!r}")
    for key, typ in types.items():
        if key not in value:
            raise bad(f"{key} is missing (pass the kv_transfer_params a prefill instance returned)")
        v = value[key]
        if not isinstance(v, typ) or isinstance(v, bool):
            raise bad(f"{key} has the wrong type ({type(v).__name__})")
    ids = value["first_token_ids"]
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad("first_token_ids must be a non-empty list of token ids")
    if not 0 < value["remote_port"] <= 65535 or value["num_prompt_tokens"] <= 0:
        raise bad("remote_port / num_prompt_tokens out of range")
    return RemotePrefill(value["remote_host"], value["remote_port"], value["remote_request_id"],
                         value["remote_engine_id"], value["num_prompt_tokens"], list(ids))


def _dealer(ctx: zmq.Context[zmq.Socket[bytes]], host: str, port: int, timeout_s: float) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, max(1, int(timeout_s * 1000)))
    sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
    sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
    sock.connect(f"tcp://{host}:{port}")
    return sock


def pull_blocks(ctx: zmq.Context[zmq.Socket[bytes]], params: RemotePrefill, first_block: int, fingerprint: str,
                timeout_s: float) -> tuple[PullReply, list[bytes]]:
    """Pull the KV blocks ``first_block, ...`` of a prompt from its prefill instance (blocking).

    Returns:
        P's reply header and the block payloads (checksums verified), ``len(payloads) ==
        ceil(num_tokens / block_size) - first_block``.

    Raises:
        TransferError: ``timeout`` (no answer within ``timeout_s``), ``unknown`` (P holds no such request:
            freed, timed out), ``fingerprint`` (another model), ``range``, ``protocol`` (a malformed reply),
            ``checksum`` (a damaged payload).
    """
    sock = _dealer(ctx, params.remote_host, params.remote_port, timeout_s)
    try:
        sock.send(ENCODER.encode(Pull(params.remote_request_id, first_block, fingerprint)))
        try:
            frames = sock.recv_multipart(copy=False)
        except zmq.Again:
            raise TransferError("timeout", f"no answer from {params.remote_host}:{params.remote_port} "
                                           f"within {timeout_s:g} s") from None
    finally:
        sock.close(linger=0)
    try:
        reply = DECODER.decode(frames[0].buffer)
    except msgspec.DecodeError as e:
        raise TransferError("protocol", f"bad reply header: {e}") from None
    if not isinstance(reply, PullReply):
        raise TransferError("protocol", f"unexpected reply {type(reply).__name__}")
    if reply.status != "ok":
        raise TransferError(reply.status, f"prefill instance answered {reply.status!r} for "
                                          f"{params.remote_request_id}")
    payloads = [f.bytes for f in frames[1:]]
    if len(payloads) != len(reply.checksums) or any(len(p) != reply.block_nbytes for p in payloads):
        raise TransferError("protocol", f"{len(payloads)} payloads for {len(reply.checksums)} checksums")
    for p, c in zip(payloads, reply.checksums, strict=True):
        if checksum(p, reply.checksum_algo) != c:
            raise TransferError("checksum", f"a KV payload of {params.remote_request_id} is damaged")
    return reply, payloads


def release_remote(ctx: zmq.Context[zmq.Socket[bytes]] | None, host: str, port: int, request_id: str,
                   timeout_s: float = 2.0) -> bool:
    """Tell a prefill instance to free the blocks it pinned for ``request_id`` (blocking).

    Returns:
        True if P held them; False if it did not (already freed) or did not answer within ``timeout_s``.
    """
    ctx = ctx or zmq.Context.instance()
    sock = _dealer(ctx, host, port, timeout_s)
    try:
        sock.send(ENCODER.encode(Release(request_id)))
        reply = DECODER.decode(sock.recv())
    except (zmq.Again, zmq.ZMQError, msgspec.DecodeError):
        return False
    finally:
        sock.close(linger=0)
    return isinstance(reply, Released) and reply.found
