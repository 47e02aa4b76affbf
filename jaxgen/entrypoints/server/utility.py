"""vLLM's utility routes and OpenAI's model lookup: POST /tokenize, POST /detokenize,
GET /version, GET /v1/models/{model}. They read the tokenizer and the model list only; nothing
reaches the engine thread."""

from __future__ import annotations

from importlib import metadata

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxgen.entrypoints.http import json_body
from jaxgen.entrypoints.protocol import APIError, chat_request, check_type
from jaxgen.errors import JaxgenError


def routes(server) -> list[Route]:
    """The routes over an `app.OpenAIServer`."""

    async def model(request: HTTPRequest) -> Response:
        try:
            server.check_auth(request)
            name = request.path_params["model"]
            for card in server.model_cards():
                if card["id"] == name:
                    return JSONResponse(card)
            raise APIError(404, f"The model '{name}' does not exist", "model",
                           code="model_not_found")  # fmt: skip
        except APIError as e:
            return e.response()

    async def tokenize(request: HTTPRequest) -> Response:
        """{"prompt": text} or {"messages": [...]} (through the chat template), with
        "add_special_tokens" (default true for a prompt) -> {"count", "max_model_len",
        "tokens"}, as vLLM answers."""
        try:
            server.check_auth(request)
            body = await json_body(
                request,
                {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                 "tools"},
            )  # fmt: skip
            server.check_model(body)
            tokenizer = server.llm.tokenizer
            if ("prompt" in body) == ("messages" in body):
                raise APIError(400, "give one of 'prompt' (text) or 'messages' (a chat)", "prompt")
            if "prompt" in body:
                text = check_type(body, "prompt", (str,), required=True)
                special = check_type(body, "add_special_tokens", (bool,))
                tokens = tokenizer.encode(text, add_special_tokens=special is not False)
            else:
                chat_fields = {k: body[k] for k in ("messages", "tools") if k in body}
                tokens = chat_request(chat_fields, server.tool_parser).prompt(server.llm)[
                    "prompt_token_ids"
                ]
        except APIError as e:
            return e.response()
        except JaxgenError as e:
            return APIError(400, str(e)).response()
        return JSONResponse(
            {
                "count": len(tokens),
                "max_model_len": server.llm.engine_cfg.max_model_len,
                "tokens": tokens,
            }
        )

    async def detokenize(request: HTTPRequest) -> Response:
        """{"tokens": [ids]} -> {"prompt": text}, as vLLM answers."""
        try:
            server.check_auth(request)
            body = await json_body(request, {"model", "tokens"})
            server.check_model(body)
            tokens = body.get("tokens")
            vocab = server.llm.processor.vocab_size
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
            ):
                raise APIError(
                    400, f"'tokens' must be a list of token ids in [0, {vocab})", "tokens"
                )
        except APIError as e:
            return e.response()
        return JSONResponse({"prompt": server.llm.tokenizer.decode(tokens)})

    async def version(request: HTTPRequest) -> Response:
        return JSONResponse({"version": metadata.version("jaxgen")})

    return [
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/version", version, methods=["GET"]),
    ]
