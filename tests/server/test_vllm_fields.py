"""vLLM's request fields and server flags against a live ``kvserve serve``: each field is honoured (a table, one
check per field) or answered with a 400 naming it; ``--generation-config``, ``--chat-template``,
``--metrics-prefix vllm``, CORS and the request log. Token-level checks run on the offline engine, whose
greedy text the server must match exactly.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_harness import MODEL, Server, sse_events

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

L = 256
# A template whose rendering the tests can write down exactly.
TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")
GEN_CONFIG = {"temperature": 0.0, "max_new_tokens": 6, "top_k": 40}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("serve")
    (d / "generation_config.json").write_text(json.dumps(GEN_CONFIG))
    (d / "template.jinja").write_text(TEMPLATE)
    s = Server("--max-model-len", str(L), "--max-num-seqs", "8", "--generation-config", str(d),
               "--chat-template", str(d / "template.jinja"), "--metrics-prefix", "vllm",
               "--allowed-origins", '["http://ok.example"]')
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(MODEL, kv_cache_memory=0.05, max_model_len=L, num_threads=1, generation_config="vllm")


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=120)


def _ok(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _stream(server: Server, path: str, body: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", server.url + path, json={"model": MODEL, "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200
        return sse_events(r.iter_lines())


def _tokenize(server: Server, **body: Any) -> list[int]:
    return list(_ok(server, "/tokenize", body)["tokens"])


def _greedy(offline: LLM, prompt: str | list[int], n: int, **kw: Any) -> Any:
    p = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
    return offline.generate([p], SamplingParams(temperature=0, max_tokens=n, **kw), use_tqdm=False)[0].outputs[0]


PROMPT = "Count: one, two, three,"
MSGS = [{"role": "user", "content": "What is the capital of France?"}]


# ---- one check per field --------------------------------------------------------------------------
def check_include_stop_str_in_output(server: Server, offline: LLM) -> None:
    text = _greedy(offline, PROMPT, 12).text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    cut = text.index(stop)
    base = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": [stop]}
    assert _ok(server, "/v1/completions", base)["choices"][0]["text"] == text[:cut]
    c = _ok(server, "/v1/completions", {**base, "include_stop_str_in_output": True})["choices"][0]
    assert c["text"] == text[:cut + len(stop)] and c["finish_reason"] == "stop" and c["stop_reason"] == stop
    events = _stream(server, "/v1/completions", {**base, "include_stop_str_in_output": True})
    assert "".join(ch["text"] for e in events[:-1] for ch in e["choices"]) == text[:cut + len(stop)]
    assert offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop=[stop],
                                                   include_stop_str_in_output=True),
                            use_tqdm=False)[0].outputs[0].text == text[:cut + len(stop)]


def check_add_generation_prompt(server: Server, offline: LLM) -> None:
    with_gp = _tokenize(server, messages=MSGS)
    without = _tokenize(server, messages=MSGS, add_generation_prompt=False)
    assert with_gp == _tokenize(server, prompt=f"<<user>>{MSGS[0]['content']}\n<<assistant>>", add_special_tokens=False)
    assert without == with_gp[:len(without)] and len(without) < len(with_gp)
    for flag, ids in ((True, with_gp), (False, without)):
        r = _ok(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "temperature": 0,
                                                 "add_generation_prompt": flag})
        assert r["usage"]["prompt_tokens"] == len(ids)
        assert r["choices"][0]["message"]["content"] == _greedy(offline, ids, 4).text


CONTINUED = [*MSGS, {"role": "assistant", "content": "The capital of France is"}]
RENDERED = f"<<user>>{MSGS[0]['content']}\n<<assistant>>The capital of France is"


def check_continue_final_message(server: Server, offline: LLM) -> None:
    ids = _tokenize(server, prompt=RENDERED, add_special_tokens=False)
    r = _ok(server, "/v1/chat/completions", {"messages": CONTINUED, "max_tokens": 5, "temperature": 0,
                                             "add_generation_prompt": False, "continue_final_message": True})
    assert r["usage"]["prompt_tokens"] == len(ids)
    assert r["choices"][0]["message"]["content"] == _greedy(offline, ids, 5).text
    bad = _post(server, "/v1/chat/completions", {"messages": CONTINUED, "continue_final_message": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


def check_chat_echo(server: Server, offline: LLM) -> None:
    body = {"messages": CONTINUED, "max_tokens": 5, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True}
    plain = _ok(server, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    echoed = _ok(server, "/v1/chat/completions", {**body, "echo": True})["choices"][0]["message"]["content"]
    assert echoed == "The capital of France is" + plain
    events = _stream(server, "/v1/chat/completions", {**body, "echo": True})
    assert "".join(ch["delta"].get("content", "") for e in events[:-1] for ch in e["choices"]) == echoed
    # the last message is the user's: nothing to echo
    r = _ok(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 3, "temperature": 0, "echo": True})
    assert not r["choices"][0]["message"]["content"].startswith(MSGS[0]["content"])


def check_truncate_prompt_tokens(server: Server, offline: LLM) -> None:
    long_ids = [(i * 7919) % 30000 + 100 for i in range(300)]  # longer than max_model_len
    r = _ok(server, "/v1/completions", {"prompt": long_ids, "max_tokens": 4, "temperature": 0,
                                        "truncate_prompt_tokens": 20})
    assert r["usage"]["prompt_tokens"] == 20
    assert r["choices"][0]["text"] == _greedy(offline, long_ids[-20:], 4).text
    assert offline.generate([{"prompt_token_ids": long_ids}], SamplingParams(
        temperature=0, max_tokens=4, truncate_prompt_tokens=20), use_tqdm=False)[0].prompt_token_ids == long_ids[-20:]
    chat = _ok(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "truncate_prompt_tokens": 5})
    assert chat["usage"]["prompt_tokens"] == 5
    bad = _post(server, "/v1/completions", {"prompt": "Hi", "truncate_prompt_tokens": L + 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"


def check_stream_options_continuous_usage_stats(server: Server, offline: LLM) -> None:
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MSGS})):
        events = _stream(server, path, {**body, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                                        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        chunks = [e for e in events[:-1] if e["choices"]]
        assert chunks and all("usage" in e for e in chunks), path
        counts = [e["usage"]["completion_tokens"] for e in chunks]
        assert counts == sorted(counts) and counts[-1] == 5
        final = events[-2]
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5
        assert {e["usage"]["prompt_tokens"] for e in chunks} == {final["usage"]["prompt_tokens"]}
        plain = _stream(server, path, {**body, "max_tokens": 2, "stream_options": {"include_usage": True}})
        assert all("usage" not in e for e in plain[:-1] if e["choices"])


def check_logit_bias(server: Server, offline: LLM) -> None:
    first = _greedy(offline, PROMPT, 1).token_ids[0]
    forced = _tokenize(server, prompt=" banana", add_special_tokens=False)[-1]
    out = _greedy(offline, PROMPT, 4, logit_bias={forced: 100.0})
    assert out.token_ids == [forced] * 4
    pushed = _greedy(offline, PROMPT, 4, logit_bias={first: -100.0})
    assert pushed.token_ids[0] != first
    r = _ok(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                        "logit_bias": {str(first): -100}})
    assert r["choices"][0]["text"] == pushed.text
    bad = _post(server, "/v1/completions", {"prompt": PROMPT, "logit_bias": {"99999999": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def check_allowed_token_ids(server: Server, offline: LLM) -> None:
    allowed = sorted({_tokenize(server, prompt=w, add_special_tokens=False)[-1] for w in (" red", " green", " blue")})
    out = _greedy(offline, PROMPT, 6, allowed_token_ids=allowed, ignore_eos=True)
    assert set(out.token_ids) <= set(allowed) and len(out.token_ids) == 6
    r = _ok(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 6, "temperature": 0,
                                             "ignore_eos": True, "allowed_token_ids": allowed})
    assert set(r["choices"][0]["message"]["content"].split()) <= {"red", "green", "blue"}
    bad = _post(server, "/v1/completions", {"prompt": PROMPT, "allowed_token_ids": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_token_ids"


def check_bad_words(server: Server, offline: LLM) -> None:
    base = _greedy(offline, PROMPT, 8)
    word = base.text.split()[0].strip(",.")
    assert word, base.text
    out = _greedy(offline, PROMPT, 8, bad_words=[word])
    tok = offline.get_tokenizer()
    banned = [tok.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    ids = out.token_ids
    for seq in banned:
        assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids))), (word, seq, ids)
    assert out.text != base.text
    r = _ok(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "bad_words": [word]})
    assert r["choices"][0]["text"] == out.text


FIELDS: dict[str, Callable[[Server, LLM], None]] = {
    "include_stop_str_in_output": check_include_stop_str_in_output,
    "add_generation_prompt": check_add_generation_prompt,
    "continue_final_message": check_continue_final_message,
    "echo (chat)": check_chat_echo,
    "truncate_prompt_tokens": check_truncate_prompt_tokens,
    "stream_options.continuous_usage_stats": check_stream_options_continuous_usage_stats,
    "logit_bias": check_logit_bias,
    "allowed_token_ids": check_allowed_token_ids,
    "bad_words": check_bad_words,
}


@pytest.mark.parametrize("field", list(FIELDS))
def test_vllm_field_is_honoured(field: str, server: Server, offline: LLM) -> None:
    FIELDS[field](server, offline)


# Fields of vLLM's or OpenAI's API that kvserve does not implement: each is a 400 that names it.
UNSUPPORTED = ["use_beam_search", "length_penalty", "spaces_between_special_tokens", "return_tokens_as_token_ids",
               "mm_processor_kwargs", "prediction", "audio", "no_such_field"]


@pytest.mark.parametrize("field", UNSUPPORTED)
def test_unsupported_field_is_a_400_naming_it(field: str, server: Server) -> None:
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": MSGS})):
        r = _post(server, path, {**body, "max_tokens": 2, field: True})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field and field in err["message"], (path, r.text)
    r = _post(server, "/v1/completions", {"prompt": "Hi", "stream": True, "stream_options": {field: True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == f"stream_options.{field}"


# ---- server flags ---------------------------------------------------------------------------------
def test_generation_config_defaults_apply_to_unset_fields(client: openai.OpenAI, offline: LLM) -> None:
    # the folder says temperature 0 and max_new_tokens 6: a request that sets neither is greedy with 6 tokens
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=2, extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [_greedy(offline, PROMPT, 6).text] * 2
    assert r.usage is not None and r.usage.completion_tokens == 12
    chat = client.chat.completions.create(model=MODEL, messages=MSGS, extra_body={"ignore_eos": True})  # type: ignore[arg-type]
    assert chat.usage is not None and chat.usage.completion_tokens == 6
    # the request's own values win
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=2, temperature=1.0, seed=5, max_tokens=8,
                                  extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 16 and r.choices[0].text != r.choices[1].text
    assert offline.get_default_sampling_params() == SamplingParams()  # generation_config="vllm": no defaults


def test_metrics_prefix_vllm_serves_the_dashboard_names(server: Server) -> None:
    _ok(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert "kvserve:" not in text
    # every series vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana) reads, but the CPU
    # swap-cache gauge
    for name in ("e2e_request_latency_seconds_bucket", "prompt_tokens_total", "generation_tokens_total",
                 "time_per_output_token_seconds_bucket", "num_requests_running", "num_requests_swapped",
                 "num_requests_waiting", "time_to_first_token_seconds_bucket", "gpu_cache_usage_perc",
                 "request_prompt_tokens_bucket", "request_generation_tokens_bucket", "request_success_total",
                 "request_queue_time_seconds_sum", "request_prefill_time_seconds_sum",
                 "request_decode_time_seconds_sum", "request_max_num_generation_tokens_sum"):
        assert f"vllm:{name}{{" in text, name
    lines = [ln for ln in text.splitlines() if ln.startswith("vllm:request_generation_tokens_count")]
    assert lines and float(lines[0].split()[-1]) >= 1


def test_cors(server: Server) -> None:
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    ok = httpx.options(server.url + "/v1/completions", headers={"Origin": "http://ok.example", **pre})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://ok.example"
    other = httpx.options(server.url + "/v1/completions", headers={"Origin": "http://evil.example", **pre})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    get = httpx.get(server.url + "/v1/models", headers={"Origin": "http://ok.example"})
    assert get.status_code == 200 and get.headers["access-control-allow-origin"] == "http://ok.example"


def test_requests_are_logged_by_default(server: Server) -> None:
    _ok(server, "/v1/completions", {"prompt": "log me please", "max_tokens": 1})
    assert "Received request cmpl-" in server.log_text() and "log me please" in server.log_text()


def test_chat_template_flag_inline_and_errors(tmp_path: Path) -> None:
    from kvserve.entrypoints.openai.server import load_chat_template
    from kvserve.errors import InvalidRequestError

    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert load_chat_template(str(f)) == TEMPLATE
    assert load_chat_template("{{ messages[0]['content'] }}\\n") == "{{ messages[0]['content'] }}\n"
    for bad in (str(tmp_path / "missing.jinja"), "{% for %}"):
        with pytest.raises(InvalidRequestError) as e:
            load_chat_template(bad)
        assert e.value.param == "chat_template"
