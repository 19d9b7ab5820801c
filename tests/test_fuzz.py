"""The HTTP API fuzzed from its own OpenAPI schema (schemathesis, seeded, a bounded number of examples per
operation) on a tiny-model server through ASGI: every response is a documented status and content type, never a
500, every /v1/ error is OpenAI's error body, and /health is 200 afterwards. Then the hostile requests found by
hand, as fixed examples."""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance
from starlette.testclient import TestClient

from hetero_spec import Engine
from hetero_spec.serve import create_app

MODEL = "tiny"
EXAMPLES = 60  # per operation and generation mode: well under a minute here, a few in CI at most


@pytest.fixture(scope="module")
def fuzz_app(chat_target):
    """The tiny target with a chat template; a short context bounds every generation (max_tokens beyond it is a
    400); the n-gram draft speculates."""
    eng = Engine.from_config({"target": {"model": str(chat_target), "dtype": "float32", "device": "cpu",
                                         "max_context": 64},
                              "draft": {"kind": "ngram"}, "runtime": {"mode": "in_process"}})
    app = create_app(eng, MODEL, own_engine=False)  # a TestClient's lifespan must not close it
    yield app
    eng.close()


@pytest.fixture(scope="module")
def api_schema(fuzz_app):
    return schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)


def openai_error_body(ctx, response, case) -> None:
    """Every error of the /v1/ endpoints is OpenAI's body: error.message (text), type, param, code."""
    if response.status_code < 400 or not case.path.startswith("/v1/"):
        return None
    err = json.loads(response.content)["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    return None


def not_a_server_error(ctx, response, case) -> None:
    assert response.status_code < 500 or response.status_code == 503 and case.path == "/health", \
        f"{response.status_code} from {case.method} {case.path}: {response.content[:500]!r}"


#: (method, path, generation mode): requests that fit the schema, and for the endpoints with a body ones that break
#: it (the GET endpoints take nothing to break)
OPERATIONS = [("POST", "/v1/completions", "positive"), ("POST", "/v1/completions", "negative"),
              ("POST", "/v1/chat/completions", "positive"), ("POST", "/v1/chat/completions", "negative"),
              ("GET", "/v1/models", "positive"), ("GET", "/health", "positive"), ("GET", "/metrics", "positive")]


@pytest.mark.parametrize("method, path, mode", OPERATIONS, ids=[f"{m} {p} {g}" for m, p, g in OPERATIONS])
def test_the_api_holds_to_its_schema(api_schema, method, path, mode):
    """Cases drawn from the schema itself (valid ones, and ones that break it): seeded, EXAMPLES of each."""
    from schemathesis import GenerationMode

    operation = api_schema[path][method]
    seen = []

    @given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        if mode == "positive" and isinstance(case.body, dict):
            case.body["model"] = MODEL  # the served model: the request reaches the engine (404s: negative cases)
        response = case.call_and_validate(checks=[not_a_server_error, status_code_conformance,
                                                  content_type_conformance, openai_error_body])
        seen.append(response.status_code)

    run()
    assert seen, "no case was generated"
    if mode == "positive" and method == "POST":
        assert 200 in seen, f"no case reached a completion: {sorted(set(seen))}"


def test_health_is_200_after_the_fuzzing(fuzz_app):
    with TestClient(fuzz_app) as client:
        assert client.get("/health").status_code == 200


HOSTILE = [
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "foo": 1}', 400, "foo"),
    (b'{"model": "tiny", "prompt": "x", "temprature": 0.5}', 400, "temprature"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": "5"}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 1000000000}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "temperature"),
    (b'{"model": "tiny", "prompt": "x", "temperature": Infinity}', 400, "temperature"),
    (b'{"model": "tiny", "prompt": "x",, }', 400, None),
    (b'[]', 400, None),
    (b'"just a string"', 400, None),
    (b'{"model": "tiny", "prompt": [99999999]}', 400, None),
    (b'{"model": "tiny", "prompt": [-1]}', 400, None),
    (b'{"model": "tiny", "prompt": ""}', 400, None),
    (b'{"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', 400, "stop"),
    (b'{"model": "tiny", "prompt": "x", "n": 3}', 400, "n"),
    (b'{"model": "tiny", "prompt": "x", "stream": "yes"}', 400, "stream"),
    (b'{"model": "tiny", "prompt": "x", "seed": -4}', 400, "seed"),
    (b'{"model": "nope", "prompt": "x"}', 404, "model"),
    (b'{"model": "tiny", "prompt": "' + b"x" * 9_000_000 + b'"}', 413, None),
]


@pytest.mark.parametrize("body, status, param", HOSTILE, ids=[f"{i}-{s}" for i, (_, s, _) in enumerate(HOSTILE)])
def test_hostile_requests_get_documented_errors(fuzz_app, body, status, param):
    with TestClient(fuzz_app) as client:
        r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == status, r.text[:500]
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
        assert client.get("/health").status_code == 200
