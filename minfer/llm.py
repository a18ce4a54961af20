"""Offline batches in a few lines, with vLLM's names:

    from minfer import LLM, SamplingParams
    llm = LLM()  # the default model; or LLM("path/or/hub-id", dtype="bfloat16", max_num_seqs=64)
    for out in llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8)):
        print(out.text)
    llm.chat([{"role": "user", "content": "Hi!"}])  # the model's chat template, as vLLM's LLM.chat
"""
from __future__ import annotations

import dataclasses
import sys
import time

import torch
from tqdm import tqdm

from .engine.core import EngineCore, RequestOutput
from .engine_args import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_PAGE_SIZE
from .errors import MinferError
from .sampling import SamplingParams
from .tokenizer import load_chat_template

Prompt = str | list[int] | dict  # text, token ids, {"prompt_token_ids": [...]} or {"prompt": text} (vLLM's)
Conversation = list[dict]  # messages: {"role": ..., "content": text or [{"type": "text", "text": ...}], ...}


class LLM:
    """The continuous-batching EngineCore, on every backend (on cuda: paged kernels, decode steps from CUDA
    graphs). async_scheduling: decode steps launched before the step before's ids are read (default: on a
    GPU). reasoning_parser (vLLM's, serve's --reasoning-parser): a structured output holds after the reasoning's end
    tag where the prompt leaves the reasoning open (EngineCore.set_reasoning_tags)."""

    def __init__(self, model: str | None = None, *, dtype: str | torch.dtype | None = None, device: str | None = None,
                 backend: str = "auto", max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, long_prefill_token_threshold: int = 0,
                 num_pages: int | None = None, block_size: int = DEFAULT_PAGE_SIZE,
                 gpu_memory_utilization: float = 0.9, enable_prefix_caching: bool | None = None, dequantize: bool = False,
                 async_scheduling: bool | None = None, cuda_graph_sizes: list[int] | None = None,
                 scheduling_policy: str = "fcfs", reasoning_parser: str | None = None):
        from .serve import reasoning
        if reasoning_parser is not None and reasoning_parser not in reasoning.PARSERS:
            raise MinferError(f"reasoning_parser must be one of {', '.join(sorted(reasoning.PARSERS))}, not "
                              f"{reasoning_parser!r}")
        if isinstance(dtype, str):
            if dtype not in ("float32", "float16", "bfloat16"):
                raise MinferError(f"dtype must be float32, float16 or bfloat16, not {dtype!r}")
            dtype = getattr(torch, dtype)
        self.engine = EngineCore(model, dtype=dtype, device=device, backend=backend, max_context=max_model_len,
                                 dequantize=dequantize, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens,
                                 long_prefill_token_threshold=long_prefill_token_threshold, num_pages=num_pages,
                                 page_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                                 prefix_caching=enable_prefix_caching, async_scheduling=async_scheduling,
                                 cuda_graph_sizes=cuda_graph_sizes, scheduling_policy=scheduling_policy)
        if reasoning_parser is not None and not self.engine.set_reasoning_tags(reasoning.START, reasoning.END):
            raise MinferError(f"reasoning_parser {reasoning_parser}: {reasoning.START} and {reasoning.END} are not each "
                              "one token of this model's vocabulary")
        self.last_stats = None  # the Stats of the last generate()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def _ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif isinstance(prompt.get("prompt"), str):
                prompt = prompt["prompt"]
            else:
                raise MinferError(f"a prompt given as a dict takes 'prompt_token_ids' or 'prompt' (text), got keys "
                                  f"{sorted(prompt)}")
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise MinferError("this model has no tokenizer: give prompts as token ids")
            return self.engine.tokenizer.encode(prompt, self.engine.max_context)
        if not isinstance(prompt, (list, tuple)):
            raise MinferError(f"a prompt is text, a list of token ids or {{'prompt_token_ids': [...]}}, not "
                              f"{type(prompt).__name__}")
        return list(prompt)

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 on_output=None, use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. sampling_params: one for all prompts or one each (default:
        SamplingParams()); with n > 1 a prompt's output is its first completion, and .outputs all n (vLLM's
        view; .siblings the RequestOutputs). on_output(index, RequestOutput): called after each step that gave
        prompt `index` tokens. use_tqdm: a progress bar of the finished prompts and the output tok/s on stderr
        (shown on a terminal). priority: each prompt's, lower first (vLLM's; needs scheduling_policy="priority")."""
        single = isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        ids = [self._ids(p) for p in prompts]
        if isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
        elif sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(ids)
        else:
            raise MinferError(f"sampling_params must be a SamplingParams or a list of them, not "
                              f"{type(sampling_params).__name__}")
        if len(params) != len(ids):
            raise MinferError(f"{len(ids)} prompts and {len(params)} sampling params")
        for sp in params:
            if not isinstance(sp, SamplingParams):
                raise MinferError(f"sampling params must be a SamplingParams, not {type(sp).__name__}")
            sp.validate()
        if priority is not None and len(priority) != len(ids):
            raise MinferError(f"{len(ids)} prompts and {len(priority)} priorities")
        # A row a completion: prompt i's n rows, seeded seed, seed + 1, ... (the server's rule for n).
        rows = [(i, c) for i, sp in enumerate(params) for c in range(sp.n)]
        row_params = [params[i] if params[i].n == 1 else dataclasses.replace(
            params[i], n=1, seed=None if params[i].seed is None else (params[i].seed + c) % 2**63) for i, c in rows]
        left = [sp.n for sp in params]  # completions of each prompt not yet finished
        with tqdm(total=len(ids), desc="Processed prompts", unit="prompt", file=sys.stderr,
                  disable=None if use_tqdm else True, dynamic_ncols=True) as bar:
            t0, tokens = time.perf_counter(), 0

            def progress(row: int, out: RequestOutput) -> None:
                nonlocal tokens
                i = rows[row][0]
                if out.finished and not bar.disable:
                    tokens += len(out.token_ids)
                    left[i] -= 1
                    bar.set_postfix_str(f"output {tokens / (time.perf_counter() - t0):.0f} tok/s", refresh=False)
                    if left[i] == 0:  # the prompt's last completion
                        bar.update(1)
                if on_output is not None:
                    on_output(i, out)

            results, self.last_stats = self.engine.generate(
                [ids[i] for i, _ in rows], row_params, None if bar.disable and on_output is None else progress,
                None if priority is None else [priority[i] for i, _ in rows])
        outputs, first = [], 0
        for i, sp in enumerate(params):
            out = results[first]
            for sibling in results[first:first + sp.n]:
                sibling.prompt = _prompt_text(prompts[i])
            if sp.n > 1:
                out.siblings = results[first:first + sp.n]
            outputs.append(out)
            first += sp.n
        return outputs

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, on_output=None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """One output per conversation, in order: each rendered by the model's chat template (or chat_template,
        a Jinja template or its file in its place), then generated as generate() does. As vLLM's: add_generation_prompt opens
        the assistant's turn; continue_final_message ends the text at the last message's content instead, for the
        model to continue; chat_template_kwargs are more of the template's variables, tools OpenAI's tool
        definitions for templates that list them. A message is a dict with a
        str 'role' and a 'content' of text or of text parts; its other keys (name, tool_calls, ...) go to the
        template as they are."""
        single = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise MinferError("messages must be a list of {'role', 'content'} dicts, or a list of such lists")
        if self.engine.tokenizer is None:
            raise MinferError("this model has no tokenizer: chat needs one")
        if chat_template is not None:
            chat_template = load_chat_template(chat_template, "chat_template")  # a file's path, or the template
        rendered = [self.engine.tokenizer.render_chat(
            _template_messages(c, "messages" if single else f"messages[{i}]"), self.engine.max_context, chat_template,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            template_kwargs=chat_template_kwargs, tools=tools) for i, c in enumerate(conversations)]
        outputs = self.generate([{"prompt_token_ids": ids} for _, ids in rendered], sampling_params, on_output,
                                use_tqdm)
        for out, (text, _) in zip(outputs, rendered):  # RequestOutput.prompt: the rendered conversation, as vLLM's
            for sibling in out.siblings or [out]:
                sibling.prompt = text
        return outputs


def _prompt_text(prompt: Prompt) -> str | None:
    """The text of a prompt given as text (RequestOutput.prompt, as vLLM's); None for token ids."""
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


TEXT_PARTS = ("text", "input_text")  # the content parts a text model reads (OpenAI's two names)


def _template_messages(conversation, where: str) -> list[dict]:
    """A conversation's messages as chat templates read them: content parts joined into one text by newlines, as
    vLLM joins them. where: the conversation's place in chat()'s argument, for the errors ("messages" when one
    conversation was given)."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise MinferError(f"{where}: a conversation is a non-empty list of message dicts")
    out = []
    for j, m in enumerate(conversation):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise MinferError(f"{where}[{j}]: a message is a dict with a str 'role'")
        content = m.get("content")
        if isinstance(content, (list, tuple)):
            if not all(isinstance(p, dict) and p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str)
                       for p in content):
                raise MinferError(f"{where}[{j}]: content parts must be {{'type': 'text', 'text': str}}")
            content = "\n".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise MinferError(f"{where}[{j}]: content must be text or a list of text parts, not "
                              f"{type(content).__name__}")
        out.append({**m, "content": content or ""})
    return out
