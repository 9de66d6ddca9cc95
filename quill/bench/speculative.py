"""`quill bench latency --speculative`: decode speed with speculation off and on, same process, same weights.

Two workloads, one request at a time (batch 1):
- quote: a ~400-token code file, then its first lines again as a plain completion prompt; the model
  goes on quoting the file (greedy), the case prompt lookup is made for (code edits, RAG answers
  that quote, rewriting);
- open: a chat request for a story, sampled (temperature 0.8, top-p 0.95, seeded), text that
  repeats little of its prompt. The same request greedy is reported too (open-greedy).
Each proposer is measured against speculation off: prompt lookup ("ngram"), and with --draft-model
or --draft-layers a draft ("draft"). The engines are interleaved, each figure is the median of
--repeats runs, and every pair of runs is checked for identical tokens (the promise speculation makes).
"""

from __future__ import annotations

import argparse
import statistics
import sys

QUOTE_FILE = '''import json
import os
from dataclasses import dataclass, field


@dataclass
class Inventory:
    """Items in a warehouse, with their counts and the shelf each one sits on."""

    name: str
    counts: dict[str, int] = field(default_factory=dict)
    shelves: dict[str, str] = field(default_factory=dict)

    def add(self, item: str, count: int, shelf: str) -> None:
        if count <= 0:
            raise ValueError(f"count must be positive, got {count}")
        self.counts[item] = self.counts.get(item, 0) + count
        self.shelves[item] = shelf

    def remove(self, item: str, count: int) -> int:
        have = self.counts.get(item, 0)
        if count > have:
            raise ValueError(f"only {have} of {item!r} left, cannot remove {count}")
        self.counts[item] = have - count
        if self.counts[item] == 0:
            del self.counts[item]
            del self.shelves[item]
        return self.counts.get(item, 0)

    def on_shelf(self, shelf: str) -> list[str]:
        return sorted(item for item, where in self.shelves.items() if where == shelf)

    def total(self) -> int:
        return sum(self.counts.values())

    def save(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"name": self.name, "counts": self.counts, "shelves": self.shelves}, f, indent=2)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "Inventory":
        with open(path) as f:
            data = json.load(f)
        return cls(data["name"], dict(data["counts"]), dict(data["shelves"]))
'''

OPEN_PROMPT = "Write a story about a lighthouse keeper who finds a message in a bottle."


def workloads(tokenizer, max_tokens: int):
    from quill.sampling_params import SamplingParams

    head = "\n".join(QUOTE_FILE.split("\n")[:4]) + "\n"
    quote = tokenizer.encode(f"# inventory.py\n{QUOTE_FILE}\n\n# inventory.py\n{head}")
    chat = tokenizer.encode_chat([{"role": "user", "content": OPEN_PROMPT}])
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    return {"quote": (quote, greedy), "open": (chat, sampled), "open-greedy": (chat, greedy)}


def _run_one(engine, ids: list[int], params) -> tuple[float, list[int], dict]:
    before = dict(engine.stats.as_dict())
    engine.add_request("spec-bench", ids, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    c = final.outputs[0]
    after = engine.stats.as_dict()
    spent = {k: after[k] - before[k] for k in ("spec_proposed_tokens", "spec_accepted_tokens", "spec_verifications")}
    return c.metrics["generation_tps"], list(c.token_ids), spent


def proposers(args: argparse.Namespace) -> dict:
    """The speculative configurations measured against "off": prompt lookup, and a draft if one is given."""
    from quill.config import SpeculativeConfig

    out = {"ngram": SpeculativeConfig("ngram", args.num_speculative_tokens)}
    if args.draft_model is not None or args.draft_layers is not None:
        out["draft"] = SpeculativeConfig.from_options("draft", args.num_speculative_tokens, args.draft_model,
                                                      args.draft_layers)
    return out


def run_speculative(args: argparse.Namespace) -> int:
    from quill.config import EngineConfig, SpeculativeConfig
    from quill.engine.engine import LLMEngine, freeze_heap

    def engine(spec, loaded=None):
        return LLMEngine(EngineConfig(model=args.model, threads=args.threads, activations=args.activations,
                                      speculative=spec), loaded=loaded)

    try:
        off = engine(SpeculativeConfig("off"))
        ons = {name: engine(spec, off.loaded) for name, spec in proposers(args).items()}
    except ValueError as e:
        print(f"quill bench latency: {e}", file=sys.stderr)
        return 2
    for name, on in ons.items():
        if on.speculator is None:
            print(f"quill bench latency: speculation ({name}) is off for this model: {on.speculative_refusal}",
                  file=sys.stderr)
            return 1
    freeze_heap()
    draft = ons["draft"].config.speculative if "draft" in ons else None
    drafted = "" if draft is None else (f", draft {draft.draft_model}" if draft.draft_model else
                                        f", draft layers {','.join(map(str, draft.draft_layers))}")
    print(f"quill bench latency --speculative: {off.model_name}, {off.threads} threads, up to "
          f"{args.num_speculative_tokens} proposed tokens{drafted}, batch 1, {args.spec_tokens} tokens per run, "
          f"median of {args.repeats}", file=sys.stderr)
    rows = []
    for name, (ids, params) in workloads(off.tokenizer, args.spec_tokens).items():
        for method, on in ons.items():
            tps = {"off": [], "on": []}
            same, spent = True, {"spec_proposed_tokens": 0, "spec_accepted_tokens": 0, "spec_verifications": 0}
            for _ in range(args.repeats):
                rate_off, tokens_off, _ = _run_one(off, ids, params)
                rate_on, tokens_on, used = _run_one(on, ids, params)
                tps["off"].append(rate_off)
                tps["on"].append(rate_on)
                same &= tokens_off == tokens_on
                spent = {k: spent[k] + used[k] for k in spent}
            rows.append(speculative_row(name, method, len(ids), tps, spent, same))
    for line in format_rows(rows):
        print(line)
    return 0 if all(r["identical"] for r in rows) else 1


def speculative_row(name: str, method: str, prompt_tokens: int, tps: dict, spent: dict, identical: bool) -> dict:
    off, on = statistics.median(tps["off"]), statistics.median(tps["on"])
    proposed, accepted, verifs = (spent["spec_proposed_tokens"], spent["spec_accepted_tokens"],
                                  spent["spec_verifications"])
    return {"workload": name, "method": method, "prompt_tokens": prompt_tokens, "off_tps": off, "on_tps": on,
            "speedup": on / off, "acceptance": accepted / proposed if proposed else 0.0,
            "mean_accepted_length": (accepted + verifs) / verifs if verifs else 0.0,
            "proposed": proposed, "identical": identical}


def format_rows(rows: list[dict]) -> list[str]:
    lines = [f"{'workload':<12} {'method':<6} {'prompt':>6} {'off tok/s':>10} {'on tok/s':>9} {'speedup':>8} "
             f"{'accepted':>9} {'tok/verify':>10} {'identical':>9}"]
    for r in rows:
        lines.append(f"{r['workload']:<12} {r['method']:<6} {r['prompt_tokens']:>6} {r['off_tps']:>10.1f} "
                     f"{r['on_tps']:>9.1f} {r['speedup']:>7.2f}x {r['acceptance']:>8.0%} "
                     f"{r['mean_accepted_length']:>10.2f} {'yes' if r['identical'] else 'NO':>9}")
    return lines
