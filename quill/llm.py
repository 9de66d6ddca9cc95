"""LLM: the offline Python API (vLLM-style), running on the same engine as the server."""

from __future__ import annotations

import itertools
from typing import Iterable, Iterator

from quill.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from quill.engine.engine import LLMEngine
from quill.outputs import RequestOutput
from quill.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class LLM:
    """`LLM(model=None)` loads the embedded default model; `generate` and `chat` batch everything given."""

    @classmethod
    def from_engine_config(cls, config: EngineConfig, loaded=None) -> "LLM":
        """Build from a full EngineConfig; `loaded` reuses weights already in memory."""
        llm = cls.__new__(cls)
        llm._init_engine(config, loaded)
        return llm

    def __init__(
        self,
        model: str | None = None,
        *,
        kv_cache_memory: int | None = None,
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        threads: int | None = None,
        device: str = "cpu",
        quantize: str | None = None,
        kv_cache_dtype: str = "auto",
        activations: str | None = None,
        cache_dir: str | None = None,
        speculative: str | None = None,
        num_speculative_tokens: int = SpeculativeConfig.num_tokens,
        draft_model: str | None = None,
        draft_layers: str | int | tuple[int, ...] | None = None,
        draft_quantize: str | None = None,
    ):
        """speculative: "ngram" (the default), "draft" (the default when draft_model or draft_layers is
        given) or "off"; outputs are the same either way, only speed changes. draft_quantize "int8":
        quantize the draft model's fp16/bf16/fp32 weights at load (an int8 copy of a folder model)."""
        config = EngineConfig(
            model=model,
            device=device,
            threads=threads,
            quantize=quantize,
            cache_dir=cache_dir,
            activations=activations,
            max_model_len=max_model_len,
            cache=CacheConfig(block_size, kv_cache_memory, enable_prefix_caching, num_kv_blocks, kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_batched_tokens, max_num_seqs),
            speculative=SpeculativeConfig.from_options(speculative, num_speculative_tokens, draft_model, draft_layers,
                                                       draft_quantize),
        )
        self._init_engine(config)

    def _init_engine(self, config: EngineConfig, loaded=None) -> None:
        self.engine = LLMEngine(config, loaded)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def _to_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        return None, list(prompt)

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt through the engine at once; outputs come back in prompt order."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        encoded = [self._to_ids(p) for p in prompts]
        return self._run(encoded, params_list)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (or `chat_template`) to each conversation, then generate.

        `tools` (OpenAI's function list) and past tool calls and results are shown to the model as
        the server shows them (quill.tools.tool_prompt, template_history): as the template's `tools`
        variable where it reads one, else described in a system message (the generic format). The
        output text is the model's own, calls included and unconstrained: read them with
        parser_class(detect_parser(llm.tokenizer.chat_template))(check_tools(tools)), or use the
        server, which also constrains and parses them.

        `chat_template_kwargs` are extra template variables, as in vLLM and transformers'
        apply_chat_template(**kwargs): e.g. {"enable_thinking": False} for Qwen3 / SmolLM3,
        {"date_string": "26 Jul 2024"} for Llama 3. Names quill sets itself (messages,
        add_generation_prompt, tools, documents) or that are not template variables
        (chat_template, tokenize, ...) raise ChatTemplateError instead of being ignored.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template_kwargs = self._template_kwargs(chat_template, chat_template_kwargs)
        encoded = [self._chat_ids(conv, add_generation_prompt, tools=tools, **template_kwargs) for conv in conversations]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(encoded)
        return self._run(encoded, params_list)

    @staticmethod
    def _template_kwargs(chat_template: str | None, chat_template_kwargs: dict | None) -> dict:
        from quill.chat_template import check_template_kwargs

        kwargs = check_template_kwargs(chat_template_kwargs)
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        return kwargs

    def _chat_ids(self, conv: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                  **template_kwargs) -> tuple[str, list[int]]:
        """(prompt text, ids); past tool calls and `tools` shown as the server shows them (quill.tools:
        template_history, tool_prompt; a ToolError names a bad entry)."""
        from quill.tools import template_history, tool_prompt

        template = template_kwargs.get("chat_template") or self.tokenizer.chat_template
        conv = template_history(conv, template)
        if tools:
            conv, extra = tool_prompt(conv, tools, template)
            template_kwargs = {**template_kwargs, **extra}
        text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, **template_kwargs)
        return text, self.tokenizer.encode_chat(conv, add_generation_prompt=add_generation_prompt, **template_kwargs)

    def generate_mixed(self, items: list[tuple[str | None, list[dict] | None]],
                       params_list: list[SamplingParams]) -> list[RequestOutput]:
        """One batch of (prompt, messages) pairs, each with its own params (for --prompts-file)."""
        encoded = [self._chat_ids(msgs) if msgs is not None else self._to_ids(prompt) for prompt, msgs in items]
        return self._run(encoded, params_list)

    def stream_chat(self, conv: list[dict], params: SamplingParams, *, chat_template: str | None = None,
                    chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step (delta_text is safe to print); the
        template options and `tools` are chat()'s."""
        text, ids = self._chat_ids(conv, tools=tools, **self._template_kwargs(chat_template, chat_template_kwargs))
        request_id = f"chat-{next(self._ids)}"
        self.engine.add_request(request_id, ids, params, prompt=text)
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        done = out.finished
                        yield out
        finally:
            if not done:
                self.engine.abort(request_id)
                self.engine.step()

    def _run(self, encoded: Iterable[tuple[str | None, list[int]]], params_list: list[SamplingParams]) -> list[RequestOutput]:
        order: list[str] = []
        try:
            for (text, ids), params in zip(encoded, params_list):
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, ids, params, prompt=text)
                order.append(request_id)
            finished: dict[str, RequestOutput] = {}
            while len(finished) < len(order):
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
        except BaseException:
            for request_id in order:  # nothing leaks if a request is refused or the loop is interrupted
                self.engine.abort(request_id)
            self.engine.step()
            raise
        return [finished[r] for r in order]
