"""OpenAI's request and response shapes (pydantic). Requests forbid unknown fields, non-finite numbers and
values of another JSON type (strict: true is no number, 2.0 no count, "1" no token id), so that an unsupported
option is a 400 naming it, not silently ignored. An explicit null means the field's default, as in OpenAI's API.
OpenAI's fields that minfer does not implement are accepted at their no-op values only."""
from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..sampling import MAX_LOGIT_BIAS
from ..structured import StructuredOutputs

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
MAX_STOP = 64  # stop strings a request: each is looked for in the new text of every step
MAX_LOGIT_BIAS_TOKENS = 300  # logit_bias entries a request


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if v is not None or k not in cls.model_fields or cls.model_fields[k].is_required()}
        return data


def unsupported(value: Any, no_op: Any) -> Any:
    """A field of OpenAI's that minfer does not implement passes at its no-op value, else a 400 that says so."""
    if value != no_op:
        raise ValueError(f"{value!r} is not supported (only {no_op!r})")
    return value


class StreamOptions(Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False

    @field_validator("continuous_usage_stats")
    @classmethod
    def _no_continuous(cls, v):
        return unsupported(v, False)


class JsonSchemaFormat(Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # absent: any JSON object
    strict: bool | None = None  # the schema is always followed


class ResponseFormat(Request):
    """OpenAI's: text, or JSON (structured outputs: minfer.structured)."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self


class StructuredOutputsField(Request):
    """vLLM's structured_outputs: exactly one of a JSON schema, any JSON object, a regex, a choice or a grammar
    (Lark, or llama.cpp's GBNF)."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(Request):
    """The fields chat and completions share; minfer's extensions (top_k, min_p, repetition_penalty,
    ignore_eos, min_tokens) as vLLM names them."""
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    min_p: float = Field(0.0, ge=0, lt=1)
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[str, float] = Field(default_factory=dict)  # token id (a JSON key) -> added to its logit
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    priority: int = Field(0, ge=-2**62, le=2**62)  # vLLM's: with --scheduling-policy priority, lower runs first
    # OpenAI's, at their no-op values only
    store: bool = False
    metadata: dict[str, str] | None = None  # labels of a stored completion: nothing is stored
    service_tier: str | None = None  # a scheduling hint: every request is served alike

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(v)}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, v):
        if len(v) > MAX_LOGIT_BIAS_TOKENS:  # every step builds each row's biases afresh
            raise ValueError(f"at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(v)}")
        for token, bias in v.items():
            if not re.fullmatch(r"[0-9]{1,10}", token):
                raise ValueError(f"keys are token ids, not {token!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"the bias of token {token} must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], not {bias}")
        if len({int(t) for t in v}) < len(v):  # "01" and "1": one token, two biases
            raise ValueError("a token id is given twice")
        return v

    @field_validator("store")
    @classmethod
    def _no_store(cls, v):
        return unsupported(v, False)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream = true")
        return self

    @field_validator("structured_outputs")
    @classmethod
    def _one_constraint(cls, v, info):
        fmt = info.data.get("response_format")
        if v is not None and fmt is not None and fmt.type != "text":
            raise ValueError("give one of response_format and structured_outputs")
        return v

    def tool_constraint(self) -> StructuredOutputs | None:
        return None  # a chat request's forced tool choice has one

    def structured(self) -> tuple[StructuredOutputs | None, str | None]:
        """The request's constraint and the field that gave it: a forced tool choice, structured_outputs, or a JSON
        response_format."""
        tools = self.tool_constraint()
        if tools is not None:
            return tools, "tool_choice"
        if self.structured_outputs is not None:
            so = self.structured_outputs
            return StructuredOutputs(json=so.json_, json_object=bool(so.json_object), regex=so.regex, choice=so.choice,
                                     grammar=so.grammar), "structured_outputs"
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None, None
        if fmt.type == "json_schema" and fmt.json_schema.schema_ is not None:
            return StructuredOutputs(json=fmt.json_schema.schema_), "response_format"
        return StructuredOutputs(json_object=True), "response_format"


class ContentPart(Request):
    """A part of a message's content: text only (a text model has nothing to read an image with)."""
    type: Literal["text", "input_text"]  # minfer.llm.TEXT_PARTS
    text: str


class Message(Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, for the chat template
    tool_call_id: str | None = None  # a tool turn's answer to that call

    def text(self) -> str:
        """The text of the content, its parts joined by newlines (vLLM's rule for templates that read a string)."""
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates read it: role and content, and the tool fields where given."""
        m = {"role": self.role, "content": self.text()}
        m.update({k: v for k in ("name", "tool_calls", "tool_call_id") if (v := getattr(self, k)) is not None})
        return m


class FunctionDefinition(Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any JSON object
    strict: bool | None = None  # the call always follows the schema


class Tool(Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Request):
    name: str


class NamedToolChoice(Request):
    type: Literal["function"]
    function: FunctionName


class TemplateFields(Request):
    """vLLM's fields for how messages become the prompt (tokenizer.Tokenizer.apply_chat_template)."""
    add_generation_prompt: bool = True  # the assistant turn's opening after the messages
    continue_final_message: bool = False  # the prompt ends inside the last message, which the model continues
    chat_template_kwargs: dict[str, Any] | None = None  # more of the template's variables (Qwen3's enable_thinking)
    tools: list[Tool] = Field(default_factory=list)  # for templates that list them (and a chat's tool_choice)

    @field_validator("continue_final_message")
    @classmethod
    def _one_way_to_end(cls, v, info):
        if v and info.data.get("add_generation_prompt"):
            raise ValueError("true needs add_generation_prompt = false")
        return v

    def render_options(self) -> dict:
        return dict(add_generation_prompt=self.add_generation_prompt,
                    continue_final_message=self.continue_final_message, template_kwargs=self.chat_template_kwargs,
                    tools=[t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None)


class ChatCompletionRequest(SamplingFields, TemplateFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # None: 'auto' where there are tools (OpenAI's default), else 'none'
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(None, validate_default=True)
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # vLLM's: False drops the reasoning that --reasoning-parser takes apart

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v, info):
        if v and not info.data.get("logprobs"):  # OpenAI's and vLLM's 400: the top-n would be dropped silently
            raise ValueError("only with logprobs = true")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _a_choice_among_the_tools(cls, v, info):
        tools = info.data.get("tools") or []
        if isinstance(v, NamedToolChoice) and v.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"names {v.function.name!r}, which is not among the tools")
        if v == "required" and not tools:
            raise ValueError("'required' needs tools")
        forced = v == "required" or isinstance(v, NamedToolChoice)
        fmt = info.data.get("response_format")
        if forced and (info.data.get("structured_outputs") is not None or (fmt is not None and fmt.type != "text")):
            raise ValueError("a forced tool call is a constraint of its own: give no response_format or "
                             "structured_outputs beside it")
        return v

    def auto_tools(self) -> bool:
        """'auto' with tools (OpenAI's default then): the model calls a tool or not, in its own format."""
        return bool(self.tools) and self.tool_choice in ("auto", None)

    def forced_tools(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def tool_constraint(self) -> StructuredOutputs | None:
        """The output a forced tool choice allows: the named function's arguments, or a JSON array of calls
        [{"name": ..., "parameters": {...}}, ...] (vLLM's form for 'required')."""
        if isinstance(self.tool_choice, NamedToolChoice):
            (tool,) = [t for t in self.tools if t.function.name == self.tool_choice.function.name]
            return StructuredOutputs(json=tool.function.parameters or {"type": "object"})
        if self.tool_choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                   "parameters": t.function.parameters or {"type": "object"}},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        return StructuredOutputs(json={"type": "array", "minItems": 1, **({} if self.parallel_tool_calls else
                                                                            {"maxItems": 1}),
                                       "items": calls[0] if len(calls) == 1 else {"anyOf": calls}})


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo, the prompt alone (as lm-evaluation-harness asks)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        return unsupported(v, "")

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of = {self.best_of} is not supported (only n, {self.n})")
        return self


class TokenizeRequest(TemplateFields):
    """vLLM's /tokenize: a prompt's ids as /v1/completions would run them, or chat messages' through the model's
    template (the generation prompt added), as /v1/chat/completions would."""
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    # The model's BOS, where it adds one: a prompt's unless false; before the template's text only if true.
    add_special_tokens: bool | None = None


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[int]


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- responses ----

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: str = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: str = "assistant"
    reasoning_content: str | None = None  # with --reasoning-parser: the reasoning, apart from the answer in content
    content: str | None = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)  # content is then the text before them, or None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: dict | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
