"""vLLM's tokenizer endpoints, so evaluation tools (lm-eval's remote tokenizer and the like)
use the server's own tokenizer instead of downloading one named after the model:

    POST /tokenize          {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
                            or {"messages": [...], "add_generation_prompt": true, "tools": [...]}
                            -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize        {"tokens": [int, ...]} -> {"prompt": str}
    GET  /tokenizer_info    the tokenizer's configuration (special tokens, chat template, lengths)

Also under /v1/. Bodies follow the limits of generation requests. (No `from __future__ import
annotations` here: FastAPI reads the route annotations, which name classes local to a function.)
"""


from typing import Annotated, Any

from fastapi import FastAPI
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from specbuild.errors import RequestError


def add_tokenizer_routes(app: FastAPI, server: Any, http: Any) -> None:
    """Register the routes on `app` for `server` (an openai_http.OpenAIServer); `http` is the
    openai_http module itself (its request models and limits; passed in, so that the two
    modules do not import each other)."""
    class TokenizeRequest(http.Strict):
        model: http.Name | None = None
        prompt: http.PromptText | None = None
        messages: Annotated[list[http.Message], Field(min_length=1, max_length=http.LIMIT_MESSAGES)] | None = None
        add_special_tokens: bool | None = None
        add_generation_prompt: bool | None = None
        return_token_strs: bool | None = None
        tools: Annotated[list[http.Tool], Field(max_length=http.LIMIT_TOOLS)] | None = None
        chat_template_kwargs: dict[str, Any] | None = None

    class DetokenizeRequest(http.Strict):
        model: http.Name | None = None
        tokens: http.TokenIds

    def check_model(name: str | None) -> None:
        if name is not None and name not in (*server.model_names, server.engine.bundle_dir):
            raise http.ApiError(404, f"model {name!r} is not served here (serving {server.model_name!r})",
                                param="model", code="model_not_found")

    def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        engine = server.engine
        if (body.prompt is None) == (body.messages is None):
            raise http.ApiError(400, "give either prompt or messages", param="prompt")
        if body.prompt is not None:
            ids = engine.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:
            from specbuild.serve import tools as tooling

            use = None
            if body.tools:
                use = tooling.ToolUse([t.model_dump(exclude_none=True) for t in body.tools], "auto",
                                      names={t.function.name for t in body.tools})
            try:
                ids = tooling.encode_prompt(engine, http.flatten_messages(body.messages), use, server.chat_template,
                                            body)
            except RequestError as e:
                raise http.ApiError(400, str(e), param="messages") from None
        out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_seq_len, "tokens": ids,
                               "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = [engine.tokenizer.id_to_token(i) for i in ids]
        return out

    def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        vocab = engine_vocab()
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise http.ApiError(400, f"tokens: id {bad[0]} is out of range [0, {vocab})", param="tokens")
        return {"prompt": server.engine.tokenizer.decode(list(body.tokens), skip_special_tokens=False)}

    def engine_vocab() -> int:
        return server.engine.tokenizer.get_vocab_size()

    def info() -> dict[str, Any]:
        engine = server.engine
        sp = engine.meta.special_tokens
        vocab = engine_vocab()

        def piece(key: str) -> str | None:
            i = sp.get(key)
            return engine.tokenizer.id_to_token(i) if isinstance(i, int) and 0 <= i < vocab else None

        return {"tokenizer_class": "PreTrainedTokenizerFast", "name_or_path": server.model_name,
                "model_max_length": engine.max_seq_len, "vocab_size": vocab,
                "bos_token": piece("bos_token_id"), "eos_token": piece("eos_token_id"),
                "pad_token": piece("pad_token_id") or piece("eos_token_id"),
                "bos_token_id": sp.get("bos_token_id"), "eos_token_id": sp.get("eos_token_id"),
                "add_bos_token": bool(sp.get("add_bos_token")),
                "chat_template": server.chat_template if server.chat_template is not None else sp.get("chat_template")}

    for prefix in ("", "/v1"):
        @app.post(f"{prefix}/tokenize", tags=["vllm"], include_in_schema=not prefix)
        async def tokenize_route(body: TokenizeRequest):
            return await run_in_threadpool(tokenize, body)

        @app.post(f"{prefix}/detokenize", tags=["vllm"], include_in_schema=not prefix)
        async def detokenize_route(body: DetokenizeRequest):
            return await run_in_threadpool(detokenize, body)

        @app.get(f"{prefix}/tokenizer_info", tags=["vllm"], include_in_schema=not prefix)
        async def info_route():
            return await run_in_threadpool(info)
