"""A test server that speaks the parts of SGLang's HTTP API the pipeline uses, over real HTTP.

Endpoints (as documented by SGLang): `GET /health`, `GET /get_model_info`, `POST /v1/chat/completions`
(OpenAI-style; with `--reasoning-parser` the thinking is returned separately in
`choices[0].message.reasoning_content`; `finish_reason` is `stop` or `length`; `usage`), and `POST /generate`
(`text` or `input_ids` + `sampling_params`; answer `text` + `meta_info` with `prompt_tokens`,
`completion_tokens`, `finish_reason: {"type": ...}`). A prompt longer than `--context-length` is rejected with
HTTP 400 and SGLang's wording.

Answers come from one of two engines:
- `--engine model` (default): the tiny demo model (transformers, CPU) generates, with the chat template;
- `--engine instant`: answers at once with a deterministic text derived from the prompt (`answer:<hash> ...`,
  thinking `thinking about <hash>`), so a test can check that every stored answer belongs to its sample;
  its "tokens" are words, and an answer longer than `max_tokens` is cut with `finish_reason: length`.

Fault injection (a fraction `--fault-rate` of the POST requests, kinds drawn from `--faults`):
`500`/`503` (HTTP errors), `drop` (connection closed without a response), `truncate` (a response body cut
short), `delay` (an answer after `--fault-delay` seconds, for client timeouts), `empty` (a 200 answer with
empty content; chat endpoint), `400` (a request rejected for another reason than its length). `--delay` adds latency to every
request, `--die-after N` kills the process (`os._exit`) on the N-th POST, like a crashed server.

Rate control (instant engine; environment variables, because the flags are SGLang's):
`DFLASH_TEST_SERVER_TOKENS_PER_S` simulates decoding: the server produces that many output tokens per second
in all, shared equally by the requests in flight (like one GPU's batch), and an answer returns when its tokens
are done; `DFLASH_TEST_SERVER_ANSWER_WORDS_PER_PROMPT_WORD` k makes an answer `--answer-words` + k x prompt
words long (longer prompts, longer answers).

It accepts `sglang.launch_server`'s flags (unknown ones are ignored), so the pipeline's SGLang launcher can
start it through the same code path: `python tests/sglang_test_server.py --model-path M --host H --port P`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import sys
import time

from aiohttp import web


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--reasoning-parser", default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--engine", choices=["model", "instant"], default="model")
    p.add_argument("--answer-words", type=int, default=12, help="instant engine: words in an answer")
    p.add_argument("--delay", type=float, default=0.0, help="seconds added to every request")
    p.add_argument("--fault-rate", type=float, default=0.0)
    p.add_argument("--faults", default="500,503,drop,truncate", help="comma-separated fault kinds")
    p.add_argument("--fault-delay", type=float, default=5.0)
    p.add_argument("--die-after", type=int, default=0, help="exit abruptly on the N-th POST request")
    p.add_argument("--startup-delay", type=float, default=0.0, help="seconds before /health answers 200")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stats-file", help="write request counts here (JSON) on every request")
    args, _unknown = p.parse_known_args(argv)  # the rest of sglang's flags (mem fraction, dp size, ...)
    return args


def _h(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=6).hexdigest()


def instant_answer(messages: list[dict], words: int) -> tuple[str, str]:
    """(thinking, answer) as a pure function of the conversation so far."""
    key = _h(json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False))
    answer = " ".join([f"answer:{key}"] + [f"w{i}" for i in range(words - 1)])
    return f"thinking about {key}", answer


END_ID = 2  # the instant engine's end token


def word_ids(text: str) -> list[int]:
    """The instant engine's "token ids": one per word, a pure function of the word."""
    return [3 + int(_h(w), 16) % 50000 for w in text.split()]


class SharedDecoder:
    """Simulated decoding: `rate` output tokens/s in total, shared equally by the requests in flight."""

    TICK_S = 0.005

    def __init__(self, rate: float):
        self.rate = rate
        self.left: dict[asyncio.Future, float] = {}
        self.task: asyncio.Task | None = None

    async def decode(self, tokens: int) -> None:
        if self.rate <= 0 or tokens <= 0:
            return
        done = asyncio.get_running_loop().create_future()
        self.left[done] = float(tokens)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run())
        try:
            await done
        finally:
            self.left.pop(done, None)  # a request whose client went away stops using its share

    async def _run(self) -> None:
        last = time.monotonic()
        while self.left:
            await asyncio.sleep(self.TICK_S)
            now = time.monotonic()
            budget, last = (now - last) * self.rate, now
            while budget > 1e-9 and self.left:  # equal shares; what a finished request leaves goes to the rest
                step = min(budget / len(self.left), min(self.left.values()))
                budget -= step * len(self.left)
                for fut in list(self.left):
                    self.left[fut] -= step
                    if self.left[fut] <= 1e-9:
                        del self.left[fut]
                        if not fut.done():
                            fut.set_result(None)


class Server:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.posts = 0
        self.faults = 0
        self.started = time.monotonic()
        self.lock = asyncio.Lock()
        self.tokenizer = self.model = None
        self.decoder = SharedDecoder(float(os.environ.get("DFLASH_TEST_SERVER_TOKENS_PER_S") or 0))
        self.words_per_prompt_word = float(os.environ.get("DFLASH_TEST_SERVER_ANSWER_WORDS_PER_PROMPT_WORD") or 0)
        if args.engine == "model":
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            torch.set_num_threads(1)
            self.tokenizer = AutoTokenizer.from_pretrained(args.model_path)
            self.model = AutoModelForCausalLM.from_pretrained(args.model_path).eval()
            self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")

    # -- faults ----------------------------------------------------------------------------------------
    async def fault(self, request) -> web.StreamResponse | None:
        self.posts += 1
        self._stats()
        if self.args.die_after and self.posts >= self.args.die_after:
            os._exit(1)
        if self.args.delay:
            await asyncio.sleep(self.args.delay)
        if self.args.fault_rate <= 0 or self.rng.random() >= self.args.fault_rate:
            return None
        self.faults += 1
        kind = self.rng.choice([k.strip() for k in self.args.faults.split(",") if k.strip()])
        if kind in ("500", "503"):
            return web.json_response({"object": "error", "message": "injected fault", "code": int(kind)},
                                     status=int(kind))
        if kind == "drop":
            request.transport.close()
            raise asyncio.CancelledError  # nothing is sent
        if kind == "400":
            return web.json_response({"object": "error", "type": "BadRequestError", "code": 400,
                                      "message": "The model `nonexistent` does not exist."}, status=400)
        if kind == "empty":
            return web.json_response({"id": "empty", "object": "chat.completion", "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "",
                                                                  "reasoning_content": None}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
        if kind == "delay":
            await asyncio.sleep(self.args.fault_delay)
            return None
        if kind == "truncate":
            body = json.dumps({"id": "x", "choices": [{"message": {"content": "cut"}}]}).encode()
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            resp.content_length = len(body)
            await resp.prepare(request)
            await resp.write(body[: len(body) // 2])
            request.transport.close()
            raise asyncio.CancelledError
        raise ValueError(f"unknown fault kind {kind}")

    def _stats(self) -> None:
        if self.args.stats_file:
            tmp = self.args.stats_file + ".tmp"
            with open(tmp, "w") as fh:
                json.dump({"posts": self.posts, "faults": self.faults, "pid": os.getpid()}, fh)
            os.replace(tmp, self.args.stats_file)

    # -- engines ---------------------------------------------------------------------------------------
    def _too_long(self, prompt_tokens: int) -> web.Response | None:
        limit = self.args.context_length
        if limit and prompt_tokens >= limit:
            return web.json_response({"object": "error", "type": "BadRequestError", "code": 400,
                                      "message": f"The input ({prompt_tokens} tokens) is longer than the model's "
                                                 f"context length ({limit} tokens)."}, status=400)
        return None

    async def _model_generate(self, ids: list[int], max_new: int, temperature: float) -> tuple[list[int], str]:
        import torch

        async with self.lock:
            def go():
                with torch.inference_mode():
                    kwargs = dict(max_new_tokens=max_new, eos_token_id=self.eos, pad_token_id=self.eos)
                    if temperature > 0:
                        torch.manual_seed(self.args.seed)
                        kwargs.update(do_sample=True, temperature=temperature)
                    else:
                        kwargs.update(do_sample=False)
                    out = self.model.generate(input_ids=torch.tensor([ids]), **kwargs)
                return out[0, len(ids):].tolist()

            new = await asyncio.to_thread(go)
        if self.eos in new:
            return new[: new.index(self.eos)], "stop"
        return new, "length"

    def _parse(self, text: str, thinking: bool) -> tuple[str | None, str]:
        if not self.args.reasoning_parser:
            return None, text
        if "</think>" in text:
            r, _, c = text.partition("</think>")
            return r.replace("<think>", "").strip("\n"), c.strip()
        if thinking and text.lstrip().startswith("<think>"):
            return text.lstrip()[len("<think>"):], ""
        return None, text.strip()

    def _answer_words(self, prompt_tokens: int) -> int:
        return self.args.answer_words + round(self.words_per_prompt_word * prompt_tokens)

    # -- handlers --------------------------------------------------------------------------------------
    async def health(self, request):
        if time.monotonic() - self.started < self.args.startup_delay:
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(self, request):
        return web.json_response({"model_path": self.args.model_path, "tokenizer_path": self.args.model_path,
                                  "is_generation": True})

    async def chat(self, request):
        body = await request.json()
        faulted = await self.fault(request)
        if faulted is not None:
            return faulted
        messages = body["messages"]
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 128)
        thinking = bool((body.get("chat_template_kwargs") or {}).get("enable_thinking", True))
        if self.args.engine == "instant":
            prompt_tokens = sum(len(m["content"].split()) for m in messages)
            too_long = self._too_long(prompt_tokens)
            if too_long:
                return too_long
            reasoning, answer = instant_answer(messages, self._answer_words(prompt_tokens))
            words = answer.split()
            finish = "length" if len(words) > max_tokens else "stop"
            content = " ".join(words[:max_tokens])
            completion_tokens = min(len(words), max_tokens)
            await self.decoder.decode(completion_tokens)
            if not thinking:
                reasoning = None
            prompt_ids = word_ids(" ".join(m["content"] for m in messages))
            output_ids = word_ids(f"{reasoning or ''} {content}") + ([END_ID] if finish == "stop" else [])
        else:
            prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                        enable_thinking=thinking)
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            prompt_tokens = len(ids)
            too_long = self._too_long(prompt_tokens + 0)
            if too_long:
                return too_long
            new, finish = await self._model_generate(ids, max_tokens, float(body.get("temperature", 0.0)))
            completion_tokens = len(new) + (finish == "stop")
            reasoning, content = self._parse(self.tokenizer.decode(new, skip_special_tokens=False), thinking)
            prompt_ids, output_ids = ids, new + ([self.eos] if finish == "stop" else [])
        if not self.args.reasoning_parser and reasoning is not None:
            content, reasoning = f"<think>\n{reasoning}\n</think>\n\n{content}", None
        choice = {"index": 0, "finish_reason": finish,
                  "message": {"role": "assistant", "content": content, "reasoning_content": reasoning}}
        if body.get("return_token_ids"):  # SGLang 0.5.23: the choice's prompt and response token ids
            choice.update(prompt_token_ids=prompt_ids, response_token_ids=output_ids)
        return web.json_response({
            "id": f"chatcmpl-{self.posts}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.args.model_path,
            "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        })

    async def generate(self, request):
        body = await request.json()
        faulted = await self.fault(request)
        if faulted is not None:
            return faulted
        sp = body.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens", 128))  # SGLang's default budget is 128
        if self.args.engine == "instant":
            text_in = body.get("text") or " ".join(map(str, body.get("input_ids") or []))
            prompt_tokens = len(text_in.split())
            too_long = self._too_long(prompt_tokens)
            if too_long:
                return too_long
            reasoning, answer = instant_answer([{"role": "user", "content": text_in}],
                                               self._answer_words(prompt_tokens))
            words = answer.split()
            finish = "length" if len(words) > max_new else "stop"
            text = f"<think>\n{reasoning}\n</think>\n\n" + " ".join(words[:max_new])
            completion_tokens = min(len(words), max_new)
            await self.decoder.decode(completion_tokens)
            output_ids = word_ids(text) + ([END_ID] if finish == "stop" else [])
        else:
            ids = body.get("input_ids") or self.tokenizer(body["text"], add_special_tokens=False)["input_ids"]
            prompt_tokens = len(ids)
            too_long = self._too_long(prompt_tokens)
            if too_long:
                return too_long
            new, finish = await self._model_generate(ids, max_new, float(sp.get("temperature", 0.0)))
            completion_tokens = len(new) + (finish == "stop")
            text = self.tokenizer.decode(new, skip_special_tokens=bool(sp.get("skip_special_tokens", True)))
            output_ids = new + ([self.eos] if finish == "stop" else [])  # SGLang: through the stop token
        reason = {"type": finish, "length": max_new} if finish == "length" else {"type": "stop", "matched": 0}
        return web.json_response({"text": text, "output_ids": output_ids, "meta_info": {
            "id": str(self.posts), "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "finish_reason": reason}})


def main(argv=None) -> None:
    args = parse_args(argv)
    server = Server(args)
    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/health", server.health)
    app.router.add_get("/get_model_info", server.model_info)
    app.router.add_post("/v1/chat/completions", server.chat)
    app.router.add_post("/generate", server.generate)
    print(f"test server on http://{args.host}:{args.port} (engine {args.engine})", file=sys.stderr, flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, handle_signals=True)


if __name__ == "__main__":
    main()
