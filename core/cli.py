"""The `adafuse` command: fused generation and the embedded default models."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from .config import FusionConfig
from .models import DEFAULT_MODELS, ModelLoadError, cache_dir, prepare_default_models

DEFAULT_PAIR = ["smollm2-135m", "gemma3-270m"]


def _add_decoding_options(parser: argparse.ArgumentParser) -> None:
    defaults = FusionConfig()
    parser.add_argument("--models", nargs="+", default=DEFAULT_PAIR, help="embedded names, Hugging Face ids or local folders")
    parser.add_argument("--tau-delta", type=float, default=defaults.tau_delta, help="confidence margin gate τΔ")
    parser.add_argument("--max-span-words", "-M", type=int, default=defaults.max_span_words, help="most words per round (M)")
    parser.add_argument("--num-branches", "-B", type=int, default=defaults.num_branches, help="branches when exploring (B)")
    parser.add_argument("--exploration", choices=["topk", "sample"], default=defaults.exploration)
    parser.add_argument("--weights", type=float, nargs="+", default=None, help="per-model weights of the fused NLL")
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable; use '\\n' for newline)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--device-map", default=None, help="e.g. cuda, auto, cpu")
    parser.add_argument("--dtype", default=None, help="e.g. float32, bfloat16 (default: the checkpoint's)")


def _generate(args: argparse.Namespace) -> int:
    from .engine import AdaFuse

    config = FusionConfig(
        tau_delta=args.tau_delta,
        max_span_words=args.max_span_words,
        num_branches=args.num_branches,
        exploration=args.exploration,
        model_weights=args.weights,
        max_new_tokens=args.max_new_tokens,
        stop=[s.encode().decode("unicode_escape") for s in args.stop],
        seed=args.seed,
    ).validate(len(args.models))
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt.encode().decode("unicode_escape") if args.escapes else args.prompt
    load_started = time.perf_counter()
    fuser = AdaFuse.from_pretrained(args.models, config, device_map=args.device_map, dtype=args.dtype)
    loaded = time.perf_counter() - load_started
    result = fuser.generate(prompt, trace=args.trace)
    if args.json:
        print(json.dumps({"text": result.text, "finish_reason": result.finish_reason, "stats": result.stats.to_dict(),
                          "trace": [vars(t) | {"candidates": [vars(c) for c in t.candidates]} for t in result.trace or []]}, indent=1))
        return 0
    if args.trace:
        for round_ in result.trace:
            gates = ", ".join(f"{m}: Δ={d:.2f}{' explore' if round_.explored[m] else ''}" for m, d in round_.margins.items())
            print(f"round {round_.index} [{gates}]")
            for c in sorted(round_.candidates, key=lambda c: c.score):
                nll = " ".join(f"{m}={v:.3f}" for m, v in c.nll.items())
                mark = "*" if c.text == round_.chosen else " "
                print(f"  {mark} {c.text + ('<end>' if c.ends else '')!r:32} fused={c.score:.3f}  {nll}  from {','.join(c.proposers)}")
    print(result.text)
    s = result.stats
    print(
        f"\n[finish={result.finish_reason} rounds={s.rounds} new_tokens={s.new_tokens} explorations={s.explorations} "
        f"forward_passes={s.forward_passes} tokens_processed={s.tokens_processed} words/round={s.words_histogram} "
        f"decode={s.wall_time_s:.2f}s load={loaded:.1f}s]",
        file=sys.stderr,
    )
    return 0


def _models(args: argparse.Namespace) -> int:
    print(f"cache: {cache_dir()}")
    folders = prepare_default_models(args.names or None)
    for name, folder in folders.items():
        print(f"{name}\t{folder}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adafuse", description="Adaptive word-level ensemble decoding of local LLMs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="fused completion of a prompt")
    generate.add_argument("prompt", help="prompt text, or - to read it from stdin")
    generate.add_argument("--escapes", action="store_true", help="interpret backslash escapes such as \\n in the prompt")
    generate.add_argument("--trace", action="store_true", help="print each round's candidates and scores")
    generate.add_argument("--json", action="store_true", help="print the result as JSON")
    _add_decoding_options(generate)
    generate.set_defaults(run=_generate)
    models = commands.add_parser("models", help="list and prepare (convert once) the embedded default models")
    models.add_argument("names", nargs="*", choices=[*DEFAULT_MODELS, []], help="which ones (default: all)")
    models.set_defaults(run=_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except (ModelLoadError, ValueError, TypeError) as error:
        print(f"adafuse: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
