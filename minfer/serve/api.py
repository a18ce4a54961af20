"""The routes: /v1/chat/completions, /v1/completions, /v1/models[/{id}], /health, /metrics.

A request is parsed and checked here (body size, JSON, fields), tokenized off the event loop, and handed to
the engine thread as one engine request per choice (n choices of each prompt). Every error leaves in OpenAI's
shape {"error": {"message", "type", "param", "code"}}. A streamed chunk is JSON built from plain values (what
pydantic's model_dump_json(exclude_none=True) gives for the response models, at a third of the cost), and
deltas that piled up for a request while the loop was busy go out as one chunk a choice.
"""
from __future__ import annotations

import asyncio
import codecs
import json
import logging
import re
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from .. import __version__
from ..errors import MinferError
from ..sampling import SamplingParams
from ..structured import renamed
from . import reasoning
from .async_engine import AsyncEngine, Delta, Outputs
from .tool_parser import PARSERS
from .protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatMessage, CompletionChoice,
                       CompletionRequest, CompletionResponse, DetokenizeRequest, ErrorInfo, ErrorResponse, FunctionCall,
                       NamedToolChoice, TokenizeRequest, ToolCall, Usage, new_id)

MAX_BODY_BYTES = 4 << 20  # a body over this is a 413 before it is parsed
MAX_SEQUENCES = 4096  # engine requests from one HTTP request (n x prompts): one request cannot hold the engine for long
TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list"}  # pydantic's names of union members in a location
# What a union field accepts, for its error message (pydantic names the union's first member only)
UNION_TYPES = {"prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
               "stop": "a string or a list of strings", "content": "a string or a list of text parts"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "internal_server_error", 503: "service_unavailable"}
dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode  # pydantic's JSON: compact, UTF-8


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "invalid_request_error"),
                                         param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


class Guard:
    """ASGI middleware: the API key on /v1, a declared body size over the limit (413) before it is read, and a
    500 for a request that raises before its response starts. Plain ASGI, not BaseHTTPMiddleware, which hides a
    client's disconnect from the route; the 500 is sent here, not by an Exception handler, after which Starlette
    re-raises and uvicorn closes the connection (a client's next request on it would fail)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if self.api_key is not None and scope["path"].startswith("/v1") and not self.authorized(headers):
            return await error_response(401, "missing or wrong API key (Authorization: Bearer KEY)")(
                scope, receive, send)
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await error_response(413, f"the body is {int(length)} bytes, over the limit of "
                                             f"{self.max_body_bytes}")(scope, receive, send)
        started = False

        async def send_seen(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_seen)
        except ClientDisconnect:  # the client left while its body came in: nobody to answer
            logging.getLogger("minfer.serve").info("%s %s: the client left", scope["method"], scope["path"])
        except Exception as e:  # a bug: this request fails, the server and the connection go on
            logging.getLogger("minfer.serve").exception("request failed")
            if started:
                raise
            await error_response(500, f"{type(e).__name__}: {e}")(scope, receive, send)

    def authorized(self, headers: dict) -> bool:
        """Authorization: Bearer KEY (the scheme in any case, RFC 9110)."""
        scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(key.strip(), self.api_key.encode())


CORS = dict(allow_origins=["*"], allow_credentials=False, allow_methods=["*"], allow_headers=["*"])


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None, max_waiting: int | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, tool_parser: str | None = None,
              reasoning_parser: str | None = None, cors: dict | None = None) -> FastAPI:
    """tool_parser: the model's tool-call format (tool_parser.PARSERS), for tool_choice 'auto'; None: 'auto' with
    tools is a 400. reasoning_parser: the model's reasoning format (reasoning.PARSERS), returned apart from the
    answer; None: all of the text is the answer. cors: CORSMiddleware's allow_origins, allow_credentials,
    allow_methods and allow_headers, each in place of its default (vLLM's: any origin, without credentials)."""
    app = FastAPI(title="minfer", docs_url=None, redoc_url=None)
    parser = PARSERS[tool_parser]() if tool_parser else None
    core, tokenizer = engine.core, engine.core.tokenizer
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):  # unknown route (404), wrong method (405)
        return error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}")

    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    # outside the guard: a browser's preflight (OPTIONS, no API key) is answered here
    app.add_middleware(CORSMiddleware, **{**CORS, **(cors or {})})

    # ---- parsing ----

    async def parse(request: Request, cls):
        body = bytearray()
        async for chunk in request.stream():  # a chunked body has no content-length: count as it comes
            body += chunk
            if len(body) > max_body_bytes:
                raise APIError(413, f"the body is over the limit of {max_body_bytes} bytes")
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"invalid JSON: {e}") from None
        except RecursionError:
            raise APIError(400, "invalid JSON: nested too deeply") from None
        try:
            req = cls.model_validate(obj)
        except ValidationError as e:
            raise APIError(400, *validation_message(e.errors())) from None
        if req.model is not None and req.model != model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {model_name!r}", "model")
        return req

    def need_tokenizer():
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: give the prompt as token ids", "prompt")

    def need_unicode(texts: list[str], param: str):
        """JSON can carry a lone surrogate ("\\ud800"), which is no text: the tokenizer raises TypeError on it."""
        for t in texts:
            try:
                t.encode()
            except UnicodeEncodeError as e:
                raise APIError(400, f"{param}: not valid Unicode ({e.reason})", param) from None

    def validation_message(errors: list[dict]) -> tuple[str, str | None]:
        """pydantic's error as (message, param). A location names a union's members ('prompt', 'str'), one error
        each: the one that reached a field inside its member (a content part's type) speaks, else the first. The
        param is the path without the member, and a union's message says what it accepts."""
        def field(p):
            return isinstance(p, str) and re.fullmatch(r"[a-z_][a-z0-9_]*", p) and p not in TYPE_NAMES

        def into_member(e):
            tags = [i for i, p in enumerate(e["loc"]) if isinstance(p, str) and not field(p)]
            return tags and any(field(p) for p in e["loc"][tags[-1] + 1:])
        err = next((e for e in errors if into_member(e)), errors[0])
        path = [str(p) for p in err["loc"] if isinstance(p, int) or field(p)]
        param = ".".join(path) or None
        in_union = len(path) < len(err["loc"])
        union = UNION_TYPES.get(path[-1]) if path and in_union and not path[-1].isdigit() else None
        msg = f"expected {union}" if union else err["msg"].removeprefix("Value error, ")
        return (f"{param}: {msg}" if param else msg), param

    def field_named(e: MinferError) -> str:
        """The core names the CLI flag (--top-p); the API names the field (top_p)."""
        return re.sub(r"^--([a-z-]+)", lambda m: m[1].replace("-", "_"), str(e))

    def params_for(req, max_tokens: int, logprobs: int | None, choice: int,
                   prompt_logprobs: int | None = None) -> SamplingParams:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        seed = None if req.seed is None else (req.seed + choice) % 2**63  # n choices of one seed differ
        try:
            return SamplingParams(temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p,
                                  min_p=req.min_p, repetition_penalty=req.repetition_penalty, seed=seed,
                                  max_tokens=max_tokens, stop=stop, ignore_eos=req.ignore_eos,
                                  include_stop_str_in_output=req.include_stop_str_in_output,
                                  allowed_token_ids=req.allowed_token_ids,
                                  presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                  logprobs=logprobs, logit_bias={int(t): b for t, b in req.logit_bias.items()},
                                  prompt_logprobs=prompt_logprobs, min_tokens=req.min_tokens,
                                  structured_outputs=req.structured()[0])
        except MinferError as e:
            message = field_named(e)
            field = re.match(r"[a-z_]+", message)
            param = field[0] if field and field[0] in type(req).model_fields else "stop" if "stop" in message else None
            raise APIError(400, message, param) from None

    # ---- running ----

    async def submit(request: Request, rid: str, prompts: list[list[int]], req, max_tokens, logprobs,
                     prompt_logprobs: int | None = None):
        """One engine request per (prompt, choice); returns their Outputs and ids. A client that leaves while
        they are handed over cancels those not taken yet and aborts the others."""
        n = req.n * len(prompts)
        if n > MAX_SEQUENCES or (max_waiting and n > max_waiting):  # never admitted (--max-waiting 0: none is)
            limit = MAX_SEQUENCES if n > MAX_SEQUENCES else max_waiting
            raise APIError(400, f"n x prompts = {n} sequences, over this server's limit of {limit} a request",
                           "n" if req.n > 1 else "prompt")
        structured, source = req.structured()
        if structured is not None:  # the constraint, checked off the event loop (the first builds llguidance's vocab)
            try:
                await asyncio.to_thread(core.matchers.check, structured)
            except MinferError as e:  # response_format's errors under its name; vLLM's fields under theirs
                raise APIError(400, str(renamed(e, source) if source == "response_format" else e), source) from None
        params = [params_for(req, max_tokens, logprobs, c, prompt_logprobs) for c in range(req.n)]
        if max_waiting is not None and engine.num_waiting + n > max_waiting:
            raise APIError(429, f"the server is busy ({engine.num_waiting} requests waiting); try again later")
        out = Outputs()
        rids = [f"{rid}-{i}" for i in range(n)]
        # all at once, so that the choices start in the same step; counted as waiting before any await
        adds = engine.add([(rids[p * req.n + c], ids, params[c], p * req.n + c)
                           for p, ids in enumerate(prompts) for c in range(req.n)], out, req.priority)
        try:
            while not (await asyncio.wait({adds}, timeout=0.25))[0]:
                if await request.is_disconnected():
                    adds.cancel()
                    raise APIError(400, "the client closed the connection")
            adds.result()
        except BaseException as e:
            for r in rids:
                engine.abort(r)
            if isinstance(e, MinferError):
                message = field_named(e)
                param = next((f for f in ("logit_bias", "priority") if message.startswith(f)), None) or (
                    source if message.startswith("structured_outputs") else "prompt" if "prompt" in message else None)
                raise APIError(400, message, param) from None
            raise
        return out, rids

    async def deltas(out: Outputs, rids: list[str]):
        """The Deltas of all choices as they come, as {choice: [its deltas since the last]}, until every
        choice has finished; an exit before that (a client gone, an error) aborts the unfinished ones."""
        left = len(rids)
        try:
            while left:
                per_choice: dict[int, list[Delta]] = {}
                for item in await out.get():
                    if isinstance(item, Exception):
                        if per_choice:  # what came before the error still goes out
                            yield per_choice
                        raise item
                    left -= item.finished
                    per_choice.setdefault(item.index, []).append(item)
                yield per_choice
        finally:
            if left:
                for r in rids:
                    engine.abort(r)

    async def collect(request: Request, out, rids) -> dict[int, list[Delta]]:
        """All deltas of a non-streamed request; a client that hangs up aborts it."""
        per_choice: dict[int, list[Delta]] = {}

        async def run():
            async for new in deltas(out, rids):
                for i, ds in new.items():
                    per_choice.setdefault(i, []).extend(ds)
            return per_choice

        task = asyncio.ensure_future(run())
        while not (await asyncio.wait({task}, timeout=0.25))[0]:
            if await request.is_disconnected():
                task.cancel()  # deltas() aborts the unfinished choices
                raise APIError(400, "the client closed the connection")
        return task.result()

    def sse(events):
        """events: the chunks' JSON texts."""
        async def gen():
            try:
                async for e in events:
                    yield f"data: {e}\n\n"
            except Exception as e:  # the status is sent already: the error goes in the stream
                logging.getLogger("minfer.serve").exception("streamed request failed")
                body = ErrorResponse(error=ErrorInfo(message=f"{type(e).__name__}: {e}", type=ERROR_TYPES[500],
                                                     code=500))
                yield f"data: {body.model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    def usage(prompts, finals: list[Delta]) -> Usage:
        p, c = sum(map(len, prompts)), sum(d.completion_tokens for d in finals)
        return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    def chunk_head(rid: str, obj: str) -> str:
        """A chunk's JSON up to its choices: the same in every chunk of a response."""
        return dumps({"id": rid, "object": obj, "created": int(time.time()), "model": model_name})[:-1] + ',"choices":'

    def finish(d: dict, finish_reason: str | None) -> dict:
        if finish_reason is not None:  # exclude_none
            d["finish_reason"] = finish_reason
        return d

    # ---- logprobs in the two shapes ----

    def piece(token_id: int) -> tuple[str, bytes]:
        """A token as logprobs show it, and its bytes. A piece of a multi-byte character is no text alone (it
        decodes to U+FFFD): it shows as "bytes:\\xNN..." (vLLM's form), and its bytes rebuild the character."""
        if tokenizer is None:
            return str(token_id), str(token_id).encode()
        if (special := tokenizer.special_text(token_id)) is not None:  # its name, as vLLM shows it; no text's bytes
            return special, b""
        text, raw = tokenizer.decode([token_id]), tokenizer.token_bytes(token_id)
        if "\ufffd" in text and raw:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, raw or text.encode()

    def chat_logprobs(entries: list[dict] | None) -> dict | None:
        if entries is None:
            return None

        def one(tid, lp):
            text, raw = piece(tid)
            return {"token": text, "logprob": lp, "bytes": list(raw)}
        return {"content": [{**one(e["token_id"], e["logprob"]), "top_logprobs": [one(t, lp) for t, lp in e["top"]]}
                            for e in entries]}

    def completion_logprobs(entries: list[dict] | None, state: list | None = None) -> dict | None:
        """text_offset: where each token's first character starts in the text (a token inside a multi-byte
        character, where that character starts): the characters of the tokens' bytes before it, counted by an
        incremental UTF-8 decoder, which holds an unfinished character back. A special token has no bytes, but one
        that the text holds as written (an entry marked "written") counts its name's. state: [offset, decoder],
        carried from one streamed delta to the next (the deltas' released text lags the tokens while a stop string
        may begin)."""
        if entries is None:
            return None
        if state is None:
            state = [0, codecs.getincrementaldecoder("utf-8")(errors="replace")]
        tokens, offsets, tops = [], [], []
        for e in entries:
            text, raw = piece(e["token_id"])
            if e.get("written"):  # a special token's name in the text
                raw = text.encode()
            tokens.append(text)
            offsets.append(state[0])
            state[0] += len(state[1].decode(raw))
            top = None if e["top"] is None else {piece(t)[0]: lp for t, lp in e["top"]}
            if top is not None:
                top.setdefault(text, e["logprob"])  # OpenAI's rule: the sampled token always, up to n + 1 entries
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries], "top_logprobs": tops,
                "text_offset": offsets}

    # ---- routes ----

    @app.get("/health")
    async def health():
        if not engine.is_alive():
            return error_response(503, "the engine loop has stopped")
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "minfer", "max_model_len": core.max_context,
                                            "vocab_size": core.cfg.vocab_size}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        for card in (await models())["data"]:
            if card["id"] == model_id:
                return card
        raise APIError(404, f"the model {model_id!r} does not exist; this server serves {model_name!r}", "model")

    async def chat_prompt(req) -> tuple[str, list[int]]:
        """A request's messages through the model's chat template: the text and its token ids."""
        need_tokenizer()
        messages = [m.for_template() for m in req.messages]
        need_unicode([m["content"] for m in messages], "messages")
        try:
            return await asyncio.to_thread(tokenizer.render_chat, messages, core.max_context, **req.render_options())
        except MinferError as e:  # the template's own errors are the messages' (raise_exception); the options name theirs
            param = next((p for p in ("chat_template_kwargs", "continue_final_message") if str(e).startswith(p)),
                         "messages")
            raise APIError(400, f"messages: {e}" if param == "messages" else str(e), param) from None

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await parse(request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give one of prompt and messages", "prompt")
        if req.messages is not None:
            _, ids = await chat_prompt(req)
            if req.add_special_tokens and tokenizer.add_bos:  # asked for on top of the template's (vLLM's rule)
                ids = [tokenizer.bos_token_id] + ids
        else:
            need_tokenizer()
            need_unicode([req.prompt], "prompt")
            try:
                ids = await asyncio.to_thread(tokenizer.encode, req.prompt, core.max_context)
            except MinferError as e:
                raise APIError(400, str(e), "prompt") from None
            if req.add_special_tokens is False and tokenizer.add_bos:
                ids = ids[1:]
        return {"count": len(ids), "max_model_len": core.max_context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await parse(request, DetokenizeRequest)
        need_tokenizer()
        if any(not 0 <= t < core.cfg.vocab_size for t in req.tokens):
            raise APIError(400, f"tokens: a token id is out of range [0, {core.cfg.vocab_size})", "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await parse(request, ChatCompletionRequest)
        if req.auto_tools() and parser is None:
            raise APIError(400, "tool_choice: 'auto' (the default with tools) needs the model's tool-call format: start "
                                "the server with --enable-auto-tool-choice --tool-call-parser NAME, or give 'required' or "
                                "a named function (the call is then constrained to the tools' schemas), or 'none'",
                           "tool_choice")
        prompt, ids = await chat_prompt(req)
        # a constrained output (a forced tool call, a schema) holds its constraint after the reasoning where the engine
        # knows the reasoning's tags (EngineCore.set_reasoning_tags), else from its first token: then it is all answer
        thinks = None if reasoning_parser is None or (req.structured()[0] is not None and core.reasoning_tags is None) \
            else (lambda: reasoning.parser(reasoning_parser, prompt))
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        rid = new_id("chatcmpl")
        max_tokens = req.max_completion_tokens or req.max_tokens or core.max_context  # default: as the context allows
        out, rids = await submit(request, rid, [ids], req, max_tokens, logprobs)
        if req.stream:
            return sse(chat_chunks(rid, req, ids, out, rids, thinks))
        per_choice = await collect(request, out, rids)
        choices = []
        for i, ds in sorted(per_choice.items()):
            thought, text = None, "".join(d.text for d in ds)
            if thinks is not None:
                thought, text = thinks().split(text)
            message = chat_message(req, text or "")
            message.reasoning_content = thought if req.include_reasoning else None
            choices.append(ChatChoice(index=i, message=message, finish_reason="tool_calls" if req.auto_tools() and
                                      message.tool_calls else ds[-1].finish_reason,
                                      logprobs=chat_logprobs([e for d in ds for e in d.logprobs] if req.logprobs else None)))
        return ChatCompletionResponse(id=rid, model=model_name, choices=choices,
                                      usage=usage([ids], [ds[-1] for ds in per_choice.values()]))

    def tool_calls(req, text: str) -> list[ToolCall] | None:
        """A forced tool choice's calls in the output: the named function's arguments, or 'required''s JSON array
        of calls; None where the text is no such array (cut by max_tokens)."""
        if isinstance(req.tool_choice, NamedToolChoice):
            return [ToolCall(function=FunctionCall(name=req.tool_choice.function.name, arguments=text))]
        try:
            calls = json.loads(text)
        except ValueError:
            return None
        return [ToolCall(function=FunctionCall(name=c["name"], arguments=json.dumps(c["parameters"], ensure_ascii=False)))
                for c in calls]

    def chat_message(req, text: str) -> ChatMessage:
        if req.auto_tools() and (parsed := parser.parse(text)) is not None:  # the calls the model wrote
            content, calls = parsed
            return ChatMessage(content=content, tool_calls=[ToolCall(function=FunctionCall(name=n, arguments=a))
                                                            for n, a in calls])
        calls = tool_calls(req, text) if req.forced_tools() else None
        return ChatMessage(content=text) if calls is None else ChatMessage(content=None, tool_calls=calls)

    class RequiredCalls:
        """tool_choice 'required' as a tool-call parser: the whole output is its JSON array of calls."""

        def __init__(self, req):
            self.req = req

        def content_end(self, text: str) -> tuple[int, bool]:
            return 0, True

        def parse(self, text: str):
            calls = tool_calls(self.req, text)
            return None if calls is None else (None, [(c.function.name, c.function.arguments) for c in calls])

    async def chat_chunks(rid, req, ids, out, rids, thinks):
        head = chunk_head(rid, "chat.completion.chunk")
        yield head + dumps([{"index": i, "delta": {"role": "assistant", "content": ""}} for i in range(req.n)]) + "}"
        finals = []
        named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
        # 'auto''s parser, or 'required''s: the text streams as content up to where a call may begin; the calls
        # come at the end (text from which none parses is content after all)
        calls_at_end = parser if req.auto_tools() else RequiredCalls(req) if req.tool_choice == "required" else None
        held, held_entries, shown = {}, {}, {}  # per choice: its text and logprobs so far, the content shown
        call_ids = {}  # a named call's id, per choice: its arguments stream as they come
        thinking = {}  # a choice's reasoning parser: its reasoning streams apart, the rest goes on as its text
        async for new in deltas(out, rids):
            for i, ds in new.items():
                last, text = ds[-1], "".join(d.text for d in ds)
                entries = [e for d in ds for e in d.logprobs] if req.logprobs else None
                if last.finished:
                    finals.append(last)
                if thinks is not None:
                    thought, text = thinking.setdefault(i, thinks()).feed(text, last.finished)
                    if thought and req.include_reasoning:
                        c = {"index": i, "delta": {"reasoning_content": thought}}
                        if entries is not None:  # the tokens so far go with the reasoning
                            c["logprobs"], entries = chat_logprobs(entries), []
                        yield head + dumps([c]) + "}"
                if calls_at_end is not None:
                    held[i] = held.get(i, "") + text
                    held_entries[i] = held_entries.get(i, []) + (entries or [])
                    end, calling = calls_at_end.content_end(held[i])
                    parsed = calls_at_end.parse(held[i]) if last.finished and calling else None
                    if last.finished and parsed is None:
                        end = len(held[i])
                    delta = {"content": held[i][shown.get(i, 0):end]}
                    if parsed is not None:
                        delta["tool_calls"] = [{"index": k, **ToolCall(function=FunctionCall(name=n, arguments=a))
                                                .model_dump()} for k, (n, a) in enumerate(parsed[1])]
                    if delta["content"] or last.finished:
                        shown[i] = shown.get(i, 0) + len(delta["content"])
                        c = {"index": i, "delta": delta}
                        if entries is not None:
                            c["logprobs"] = chat_logprobs(held_entries.pop(i))
                        reason = "tool_calls" if parsed is not None and req.auto_tools() else last.finish_reason
                        yield head + dumps([finish(c, reason)]) + "}"
                elif named is not None and (text or last.finished):
                    call = {"index": 0, "function": {"arguments": text}}
                    if i not in call_ids:
                        call_ids[i] = ToolCall(function=FunctionCall(name=named, arguments="")).id
                        call = {"index": 0, "id": call_ids[i], "type": "function",
                                "function": {"name": named, "arguments": text}}
                    c = {"index": i, "delta": {"tool_calls": [call]}}
                    if entries is not None:
                        c["logprobs"] = chat_logprobs(entries)
                    yield head + dumps([finish(c, last.finish_reason)]) + "}"
                elif text or last.finished or entries:
                    c = {"index": i, "delta": {"content": text}}
                    if entries is not None:
                        c["logprobs"] = chat_logprobs(entries)
                    yield head + dumps([finish(c, last.finish_reason)]) + "}"
        if req.stream_options and req.stream_options.include_usage:
            yield head + '[],"usage":' + usage([ids], finals).model_dump_json() + "}"

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens: 0 only with echo = true (the prompt alone)", "max_tokens")
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
            need_tokenizer()
            texts = [prompt] if isinstance(prompt, str) else prompt
            need_unicode(texts, "prompt")
            try:
                prompts = await asyncio.to_thread(lambda: [tokenizer.encode(t, core.max_context) for t in texts])
            except MinferError as e:
                raise APIError(400, str(e), "prompt") from None
        else:
            texts = None
            prompts = [prompt] if prompt and isinstance(prompt[0], int) else prompt
        if not prompts:
            raise APIError(400, "prompt: no prompt given", "prompt")
        if req.echo and texts is None:
            need_tokenizer()
        rid = new_id("cmpl")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
        # 0 (with echo): the prompt alone, which the engine scores for its logprobs (asked for even if none are shown)
        prompt_logprobs = (req.logprobs or 0) if max_tokens == 0 else req.logprobs if req.echo else None
        out, rids = await submit(request, rid, prompts, req, max_tokens, req.logprobs, prompt_logprobs)
        pieces = CompletionPieces(req, prompts, texts)
        if req.stream:
            return sse(completion_chunks(rid, req, pieces, out, rids))
        per_choice = await collect(request, out, rids)
        choices = []
        for i, ds in sorted(per_choice.items()):
            text, entries = pieces.of(i, ds)
            choices.append(CompletionChoice(index=i, text=text, logprobs=completion_logprobs(entries),
                                            finish_reason=ds[-1].finish_reason))
        return CompletionResponse(id=rid, model=model_name, choices=choices,
                                  usage=usage(prompts, [ds[-1] for ds in per_choice.values()]))

    class CompletionPieces:
        """A completion choice's text and logprob entries from its deltas, the echoed prompt's before the first."""

        def __init__(self, req, prompts: list[list[int]], texts: list[str] | None):
            self.req, self.prompts, self.texts = req, prompts, texts
            self.started: set[int] = set()  # choices whose first delta was seen

        def of(self, i: int, ds: list[Delta]) -> tuple[str, list[dict] | None]:
            req = self.req
            text = "".join(d.text for d in ds)
            entries = None if req.logprobs is None else [e for d in ds for e in d.logprobs]
            if req.echo and i not in self.started:  # the prompt before the text, its tokens' logprobs before theirs
                p = i // req.n
                text = (self.texts[p] if self.texts is not None else tokenizer.decode(self.prompts[p])) + text
                if entries is not None:
                    first = {"token_id": self.prompts[p][0], "logprob": None, "top": None}  # nothing predicts it
                    entries = [*self.written(p, [first, *ds[0].prompt_logprobs[1:]]), *entries]
            self.started.add(i)
            return text, entries

        def written(self, p: int, entries: list[dict]) -> list[dict]:
            """Prompt p's entries, its special tokens marked "written" where the echoed text holds their names: a
            prompt given as text is echoed as written (but for the BOS that encode adds), one given as ids decoded
            without them."""
            if self.texts is None:
                return entries
            added = 1 if tokenizer.add_bos else 0
            return [{**e, "written": True} if k >= added and tokenizer.special_text(e["token_id"]) is not None else e
                    for k, e in enumerate(entries)]

    async def completion_chunks(rid, req, pieces: CompletionPieces, out, rids):
        head = chunk_head(rid, "text_completion")
        finals, states = [], {}  # per choice: completion_logprobs' [offset, decoder], carried from chunk to chunk
        async for new in deltas(out, rids):
            for i, ds in new.items():
                last = ds[-1]
                text, entries = pieces.of(i, ds)
                if text or last.finished or entries:
                    c = {"index": i, "text": text}
                    if entries is not None:  # the offsets run on from the chunks before (their tokens, not text)
                        state = states.setdefault(i, [0, codecs.getincrementaldecoder("utf-8")(errors="replace")])
                        c["logprobs"] = completion_logprobs(entries, state)
                    yield head + dumps([finish(c, last.finish_reason)]) + "}"
                if last.finished:
                    finals.append(last)
        if req.stream_options and req.stream_options.include_usage:
            yield head + '[],"usage":' + usage(pieces.prompts, finals).model_dump_json() + "}"

    return app
