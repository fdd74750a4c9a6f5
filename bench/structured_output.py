"""What structured output costs: tokens/s with a JSON schema against plain decoding, with
speculation off and on (the demo target and its DFlash drafter, in one process).

Four rows, taking turns `--repeat` times (medians), as ratios against plain target-only:
plain and JSON-constrained, each target-only and with the drafter (the adaptive policy, one
engine per kind of output, so each learns its own traffic's acceptance). A constrained step computes
K+1 grammar masks per sequence on the engine thread (one per draft position, llguidance) and
rejects the drafts the grammar forbids; these rows show what that costs and how much of the
speculative speedup survives. Figures on a shared machine are noisy: compare ratios within
one run.

  .venv/bin/python bench/structured_output.py [--models demo] [--prompts 8] [--new-tokens 128] [--policy fixed]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import demo_pair_args, held_out_prompts, one_at_a_time  # noqa: E402
from bench.compare import engine_config, in_process_engine  # noqa: E402
from bench.pools import pool_folder  # noqa: E402
from target_service.api_types import StructuredOutputKind, StructuredOutputParams  # noqa: E402
from target_service.engine import build_engine_core  # noqa: E402
from target_service.engine_core import EngineCore  # noqa: E402
from target_service.structured_output import CompiledGrammar, GrammarCompiler  # noqa: E402

# A record a code model can fill: bounded strings and numbers, an enum, a short array.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["function", "class", "module"]},
        "lines": {"type": "integer", "minimum": 1, "maximum": 9999},
        "args": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "pure": {"type": "boolean"},
    },
    "required": ["name", "kind", "lines", "args", "pure"],
    "additionalProperties": False,
}


def run(core: EngineCore, prompts: list[list[int]], new_tokens: int, grammar: CompiledGrammar | None,
        params: StructuredOutputParams | None) -> tuple[int, float, int, int]:
    """Every prompt one at a time (concurrency 1); (tokens, seconds, drafted, accepted)."""
    tokens, seconds, usages = one_at_a_time(core, prompts, new_tokens, structured_output=params, grammar=grammar)
    return tokens, seconds, sum(u.draft_tokens for u in usages), sum(u.accepted_tokens for u in usages)


def main(argv: list[str] | None = None) -> int:
    parser = demo_pair_args(__doc__, prompts=8, new_tokens=128)
    parser.add_argument("--policy", choices=("adaptive", "fixed"), default="adaptive",
                        help="fixed: K drafts every step, what drafting costs where it does not pay")
    args = parser.parse_args(argv)
    prompts = held_out_prompts(args)
    params = StructuredOutputParams(StructuredOutputKind.JSON_SCHEMA, json.dumps(SCHEMA), disable_any_whitespace=True)
    with tempfile.TemporaryDirectory(dir=pool_folder()) as shm_dir:
        plain = build_engine_core(engine_config(args.models, shm_dir, args.k))
        # one speculative engine per output kind: each policy learns its own traffic's acceptance
        speculative = in_process_engine(args.models, shm_dir, args.k, "dflash", args.policy)
        constrained = in_process_engine(args.models, shm_dir, args.k, "dflash", args.policy)
        for core in (plain, speculative, constrained):
            core.warmup()
        info = plain.model_info
        grammar = GrammarCompiler(plain.tokenizer, info.vocab_size, info.eos_token_ids).compile(params)
        rows = {("plain", "target only"): (plain, None, None), ("plain", "+ dflash"): (speculative, None, None),
                ("json schema", "target only"): (plain, grammar, params),
                ("json schema", "+ dflash"): (constrained, grammar, params)}
        rates: dict[tuple[str, str], list[float]] = {}
        lengths: dict[tuple[str, str], list[float]] = {}
        drafts: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for _ in range(args.repeat):
            for key, (core, g, p) in rows.items():
                tokens, seconds, drafted, accepted = run(core, prompts, args.new_tokens, g, p)
                rates.setdefault(key, []).append(tokens / seconds)
                lengths.setdefault(key, []).append(tokens / len(prompts))
                drafts.setdefault(key, []).append((drafted, accepted))
        base = statistics.median(rates[("plain", "target only")])
        print(f"concurrency 1, {args.prompts} prompts, at most {args.new_tokens} tokens each (a JSON output ends "
              f"with its schema), median of {args.repeat}, {args.threads} thread(s), {args.policy} policy; tokens/s "
              "(x plain target only)")
        for (output, engine), values in rates.items():
            rate = statistics.median(values)
            mean_len = statistics.median(lengths[(output, engine)])
            drafted = sum(d for d, _ in drafts[(output, engine)])
            accepted = sum(a for _, a in drafts[(output, engine)])
            acceptance = f"{accepted}/{drafted} drafts accepted" if drafted else "no drafts"
            print(f"  {output:12s} {engine:12s} {rate:7.1f}  ({rate / base:.2f}x)  {mean_len:5.1f} tokens/request, "
                  f"{acceptance}")
        for core in (plain, speculative, constrained):
            core.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
