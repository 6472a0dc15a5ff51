"""Agent and structured-output libraries against `specbuild serve` over a socket: instructor's
TOOLS mode, LangChain's bind_tools, with_structured_output(method="function_calling") and
stream_usage. Their installs are large (instructor pins an older openai; LangChain pulls
langsmith and tiktoken), so scripts/setup.sh does not install them: these tests carry the
`clients` marker and skip without the packages (`pip install instructor langchain-openai`,
docs/clients.md)."""

from __future__ import annotations

from typing import Literal

import pytest
from http_client import ServerProcess
from pydantic import BaseModel, Field
from tiny import draft_pair_bundle

pytestmark = [pytest.mark.clients, pytest.mark.timeout(300)]
openai = pytest.importorskip("openai")


class Forecast(BaseModel):
    """The weather forecast to look up."""

    unit: Literal["c", "f"]
    days: int = Field(ge=1, le=3)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    bundle = draft_pair_bundle(tmp_path_factory.mktemp("libs"), noise=0.05, max_seq_len=2048, max_batch_size=8)
    srv = ServerProcess(bundle, str(tmp_path_factory.mktemp("logs") / "libs.log"), "--max-batch-size", "4")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return f"http://127.0.0.1:{server.port}/v1"


def test_instructor_tools_mode(base_url):
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0),
                                    mode=instructor.Mode.TOOLS)
    for method in ("none", "draft"):
        out = client.chat.completions.create(model="bundle", response_model=Forecast, max_retries=0, max_tokens=600,
                                             messages=[{"role": "user", "content": "forecast please"}],
                                             extra_body={"speculation": method})
        assert isinstance(out, Forecast) and out.unit in ("c", "f") and 1 <= out.days <= 3


def test_langchain_bind_tools_and_structured_output(base_url):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(model="bundle", base_url=base_url, api_key="unused", max_retries=0, max_tokens=600,
                        temperature=0)
    message = llm.bind_tools([Forecast], tool_choice="required").invoke("forecast please")
    assert message.tool_calls and message.tool_calls[0]["name"] == "Forecast"
    Forecast.model_validate(message.tool_calls[0]["args"])
    out = llm.with_structured_output(Forecast, method="function_calling").invoke("forecast please")
    assert isinstance(out, Forecast)
    # the tool turn goes back into the history
    history = ["forecast please", message, {"role": "tool", "content": "sunny",
                                            "tool_call_id": message.tool_calls[0]["id"]}]
    follow = llm.bind_tools([Forecast]).invoke(history)
    assert follow.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


def test_langchain_stream_usage_counts_once(base_url):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(model="bundle", base_url=base_url, api_key="unused", max_retries=0, max_tokens=12,
                        temperature=0, stream_usage=True, extra_body={"ignore_eos": True})
    whole = llm.invoke("count")
    total = None
    for chunk in llm.stream("count"):
        total = chunk if total is None else total + chunk
    assert total.usage_metadata["output_tokens"] == whole.usage_metadata["output_tokens"] == 12
    assert total.usage_metadata["input_tokens"] == whole.usage_metadata["input_tokens"]
