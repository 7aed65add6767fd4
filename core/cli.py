"""The `adafuse` command: fused generation and the embedded default models."""
from __future__ import annotations

import argparse
import codecs
import json
import logging
import os
import re
import shlex
import sys
import time
from pathlib import Path

from .config import FusionConfig
from .files import write_text_atomically
from .models import DEFAULT_ENSEMBLE, DEFAULT_MODELS, ModelLoadError, cache_dir, prepare_default_models

# Where the benchmark data sits when neither --data nor $ADAFUSE_DATA says: beside the project, as in a checkout.
_FALLBACK_DATA = Path("..") / "shared" / "benchmarks"


def _add_decoding_options(parser: argparse.ArgumentParser) -> None:
    defaults = FusionConfig()
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_ENSEMBLE), help="embedded names, Hugging Face ids or local folders")
    parser.add_argument("--tau-delta", type=float, default=defaults.tau_delta, help="confidence margin gate τΔ")
    parser.add_argument("--max-span-words", "-M", type=int, default=defaults.max_span_words, help="most words per round (M)")
    parser.add_argument("--num-branches", "-B", type=int, default=defaults.num_branches, help="branches when exploring (B)")
    parser.add_argument("--exploration", choices=["topk", "sample"], default=defaults.exploration)
    parser.add_argument("--weights", type=float, nargs="+", default=None, help="per-model weights of the fused NLL")
    parser.add_argument("--scoring", choices=["mean", "competence"], default=defaults.scoring,
                        help="mean: the paper's weighted mean NLL; competence: weights scaled per prompt by each model's NLL of its demonstrations")
    parser.add_argument("--competence-sharpness", type=float, default=defaults.competence_sharpness,
                        help="how fast a model's weight falls per nat/char it trails the best model by")
    parser.add_argument("--confidence-sharpness", type=float, default=defaults.confidence_sharpness,
                        help="per round, how fast a model's weight falls with its NLL of its likeliest candidate (0: off)")
    parser.add_argument("--veto-margin", type=float, default=defaults.veto_margin,
                        help="NLL (in the unit of span_normalization) by which a candidate may trail the most-weighted model's favourite and still win")
    parser.add_argument("--rerank", choices=["off", "members", "all"], default=defaults.rerank,
                        help="choose among whole answers: each model's own (members), or those and the fused one (all)")
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--min-new-tokens", type=int, default=defaults.min_new_tokens,
                        help="tokens the answer must have before it may end (0: it may be empty)")
    parser.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable; use '\\n' for newline)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--fusion-gate", default=None, help="folder or shipped name of a learned gate used instead of --tau-delta")
    parser.add_argument("--token-adapter", default=None, help="sample with the adapter's model, a learned temperature per step")
    parser.add_argument("--sequence-adapter", default=None, help="sample with the adapter's model, a learned configuration per prompt")
    parser.add_argument("--num-samples", type=int, default=defaults.num_samples, help="parallel samples, majority-voted (with an adapter)")
    parser.add_argument("--device-map", default=None, help="e.g. cuda, auto, cpu")
    parser.add_argument("--dtype", default=None, help="e.g. float32, bfloat16 (default: the checkpoint's)")


# Python's backslash escapes, matched one by one so that the text around them keeps its own characters.
_ESCAPE = re.compile(r"\\(?:[\\'\"abfnrtv0]|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|N\{[^}]+\})")


def _unescape(text: str) -> str:
    """Interpret escapes such as \\n or \\u00e9 in `text`; other characters (é, emoji) stay as they are."""
    return _ESCAPE.sub(lambda match: codecs.decode(match.group(0), "unicode_escape"), text)


def _read_stdin() -> str:
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"the prompt on stdin is not UTF-8 text (byte {data[error.start]:#04x} at offset "
                         f"{error.start})") from None


def _config(args: argparse.Namespace) -> FusionConfig:
    return FusionConfig(
        tau_delta=args.tau_delta,
        max_span_words=args.max_span_words,
        num_branches=args.num_branches,
        exploration=args.exploration,
        model_weights=args.weights,
        scoring=args.scoring,
        competence_sharpness=args.competence_sharpness,
        confidence_sharpness=args.confidence_sharpness,
        veto_margin=args.veto_margin,
        rerank=args.rerank,
        max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.min_new_tokens,
        stop=[_unescape(s) for s in args.stop],
        seed=args.seed,
        fusion_gate=args.fusion_gate,
        token_adapter=args.token_adapter,
        sequence_adapter=args.sequence_adapter,
        num_samples=args.num_samples,
    ).validate(len(args.models))


def _generate(args: argparse.Namespace) -> int:
    from .fusion.engine import AdaFuse

    config = _config(args)
    prompt = _read_stdin() if args.prompt == "-" else _unescape(args.prompt) if args.escapes else args.prompt
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


def _eval(args: argparse.Namespace) -> int:
    from .eval.benchmarks import BENCHMARKS
    from .eval.harness import Evaluator
    from .eval.methods import expand_methods
    from .fusion.engine import AdaFuse

    benches = list(BENCHMARKS) if args.bench == "all" else [b.strip() for b in args.bench.split(",") if b.strip()]
    unknown = [b for b in benches if b not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)} or all")
    methods = expand_methods(args.methods, list(args.models))
    fuser = AdaFuse.from_pretrained(args.models, FusionConfig(seed=args.seed), device_map=args.device_map, dtype=args.dtype)
    evaluator = Evaluator(fuser, _data_root(args), Path(args.out), max_new_tokens=args.max_new_tokens)
    if not args.report_only:
        evaluator.run(benches, methods, args.limit, batch_size=args.batch_size, first_row=args.first_row)
    print(evaluator.report(args.invocation))
    return 0


def _train_adapter(args: argparse.Namespace) -> int:
    import torch

    torch.manual_seed(args.seed)
    out = Path(args.out)
    if args.kind == "gate":
        adapter, history = _train_gate(args, out)
    else:
        adapter, history = _train_sampling_adapter(args, out)
    adapter.save(out)
    write_text_atomically(out / "training.json", json.dumps({"command": args.invocation, "task": args.task, "history": history}, indent=1))
    print(f"saved {out} after {len(history)} steps; mean reward of the last 10: "
          f"{sum(h['reward'] for h in history[-10:]) / max(1, len(history[-10:])):.3f}")
    return 0


def _training_tasks(args: argparse.Namespace):
    from .training.tasks import arithmetic_tasks, benchmark_tasks

    if args.task == "arithmetic":
        return arithmetic_tasks(args.train_prompts, seed=args.seed)
    first = args.first_row
    return benchmark_tasks(args.task, range(first, first + args.train_prompts), _data_root(args))


def _data_root(args: argparse.Namespace) -> Path:
    """--data, else $ADAFUSE_DATA, else ../shared/benchmarks."""
    from .eval.benchmarks import benchmark_root

    return benchmark_root(args.data or os.environ.get("ADAFUSE_DATA") or _FALLBACK_DATA)


def _train_gate(args: argparse.Namespace, out: Path):
    from .fusion.engine import AdaFuse
    from .fusion.gate import FusionGate
    from .training.gate import train_fusion_gate
    from .training.tasks import task_stop

    fuser = AdaFuse.from_pretrained(args.models, device_map=args.device_map, dtype=args.dtype)
    tasks = _training_tasks(args)
    stop = task_stop(tasks)
    out.mkdir(parents=True, exist_ok=True)
    gate = FusionGate([b.hidden_size for b in fuser.backends], fuser.model_names)
    history = train_fusion_gate(fuser, gate, tasks, steps=args.steps, prompts_per_step=args.prompts_per_step,
                                samples_per_prompt=args.samples, forward_cost=args.forward_cost,
                                max_new_tokens=args.max_new_tokens, stop=stop, learning_rate=args.learning_rate,
                                batch_size=args.batch_size, checkpoint=out / "checkpoint.safetensors", seed=args.seed)
    return gate, history


def _train_sampling_adapter(args: argparse.Namespace, out: Path):
    from .backend import ModelBackend
    from .sampling.adaptive import prompt_embeddings
    from .sampling.policies import SequenceAdapter, TokenAdapter
    from .training.adapters import CANDIDATE_CHOICES, reward_table, train_sequence_adapter, train_token_adapter
    from .training.reinforce import greedy_coverage

    backend = ModelBackend.from_pretrained(args.model, device_map=args.device_map, dtype=args.dtype)
    tasks = _training_tasks(args)
    out.mkdir(parents=True, exist_ok=True)
    hidden_size = backend.hidden_size
    if args.kind == "token":
        adapter = TokenAdapter(hidden_size, base_model=args.model)
        history = train_token_adapter(backend, adapter, tasks, steps=args.steps, prompts_per_step=args.prompts_per_step,
                                      samples_per_prompt=args.samples, max_new_tokens=args.max_new_tokens,
                                      learning_rate=args.learning_rate, checkpoint=out / "checkpoint.safetensors", seed=args.seed)
        return adapter, history
    single = reward_table(backend, tasks, list(CANDIDATE_CHOICES), 1, args.max_new_tokens, args.seed)
    choices = [CANDIDATE_CHOICES[i] for i in greedy_coverage(single, args.actions)]
    tables = {1: single[:, [CANDIDATE_CHOICES.index(c) for c in choices]]}
    for budget in (4,):
        tables[budget] = reward_table(backend, tasks, choices, budget, args.max_new_tokens, args.seed + budget)
    adapter = SequenceAdapter(hidden_size, choices, base_model=args.model)
    history = train_sequence_adapter(adapter, prompt_embeddings(backend, [t.prompt for t in tasks]), tables,
                                     steps=args.steps, learning_rate=args.learning_rate, seed=args.seed)
    return adapter, history


def _serve(args: argparse.Namespace) -> int:
    from .fusion.engine import AdaFuse

    try:
        from .server import serve
    except ImportError as error:
        raise ValueError(f"adafuse serve needs FastAPI and uvicorn ({error}): pip install 'adafuse[serve]'") from None
    fuser = AdaFuse.from_pretrained(args.models, _config(args), device_map=args.device_map, dtype=args.dtype)
    fuser.batcher.max_batch_size = args.max_batch_size
    serve(fuser, args.host, args.port, model_name=args.served_model_name, max_pending=args.max_pending,
          max_tokens=args.max_new_tokens)
    return 0


def _models(args: argparse.Namespace) -> int:
    print(f"cache: {cache_dir()}")
    folders = prepare_default_models(args.names or None)
    for name, folder in folders.items():
        print(f"{name}\t{folder}")
    for model in DEFAULT_MODELS.values():
        if model.name not in folders and not model.installed:
            print(f"{model.name}\tnot installed ({model.install_hint})")
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
    evaluate = commands.add_parser("eval", help="run methods over the benchmarks and write a report (resumable)")
    evaluate.add_argument("--bench", default="all", help="comma list of nq, triviaqa, squad, gsm8k, flores_en_de, flores_de_en, or all")
    evaluate.add_argument("--methods", default="single,adafuse", help="comma list: single, adafuse, adafuse:tau=X, adafuse:B=N, "
                          "fixed:N, unite, rerank, or the groups ablations, baselines, sweep, all")
    evaluate.add_argument("--limit", type=int, default=None, help="N rows of each benchmark (default: all)")
    evaluate.add_argument("--first-row", type=int, default=0, help="first development row to run (tune on one slice, report on another)")
    evaluate.add_argument("--out", default="reports/eval", help="folder for predictions.jsonl, report.md and plots")
    evaluate.add_argument("--data", default=None, help="benchmark folder (default: $ADAFUSE_DATA, else ../shared/benchmarks)")
    evaluate.add_argument("--batch-size", type=int, default=1, help="prompts in flight, continuous batching (1 gives exact per-example times)")
    evaluate.add_argument("--max-new-tokens", type=int, default=None, help="cap on each benchmark's generation budget")
    evaluate.add_argument("--report-only", action="store_true", help="rewrite the report from predictions.jsonl, run nothing")
    evaluate.add_argument("--models", nargs="+", default=list(DEFAULT_ENSEMBLE))
    evaluate.add_argument("--seed", type=int, default=0)
    evaluate.add_argument("--device-map", default=None)
    evaluate.add_argument("--dtype", default=None)
    evaluate.set_defaults(run=_eval)
    train = commands.add_parser("train-adapter", help="train a decoding adapter or a fusion gate with REINFORCE (resumable)")
    train.add_argument("--kind", choices=["token", "sequence", "gate"], default="token",
                       help="token/sequence: single-model sampling adapters; gate: AdaFuse's commit/explore decision")
    train.add_argument("--model", default="smollm2-135m", help="token/sequence: the frozen model")
    train.add_argument("--models", nargs="+", default=list(DEFAULT_ENSEMBLE), help="gate: the fused models")
    train.add_argument("--actions", type=int, default=4, help="sequence adapter: configurations kept by greedy coverage")
    train.add_argument("--task", default="arithmetic", help="arithmetic (generated sums) or a QA/math benchmark, e.g. squad")
    train.add_argument("--first-row", type=int, default=400, help="benchmark tasks: first training row (rows before it stay held aside)")
    train.add_argument("--data", default=None, help="benchmark folder (default: $ADAFUSE_DATA, else ../shared/benchmarks)")
    train.add_argument("--forward-cost", type=float, default=0.005, help="gate: reward lost per forward pass")
    train.add_argument("--batch-size", type=int, default=None, help="gate: rollouts decoded together (default: all of a step)")
    train.add_argument("--steps", type=int, default=60)
    train.add_argument("--prompts-per-step", type=int, default=8)
    train.add_argument("--samples", type=int, default=4, help="samples per prompt (the per-prompt baseline)")
    train.add_argument("--train-prompts", type=int, default=400)
    train.add_argument("--max-new-tokens", type=int, default=4)
    train.add_argument("--learning-rate", type=float, default=3e-3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--out", default="adapters/token")
    train.add_argument("--device-map", default=None)
    train.add_argument("--dtype", default=None)
    train.set_defaults(run=_train_adapter)
    server = commands.add_parser("serve", help="an OpenAI-compatible server (/v1/completions, /v1/chat/completions)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--served-model-name", default=None, help="the model id clients send (default: adafuse(a+b))")
    server.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together")
    server.add_argument("--max-pending", type=int, default=64, help="requests in flight before 429")
    _add_decoding_options(server)
    server.set_defaults(run=_serve, max_new_tokens=256)
    models = commands.add_parser("models", help="list and prepare (convert once) the embedded default models")
    models.add_argument("names", nargs="*", choices=[*DEFAULT_MODELS, []], help="which ones (default: all)")
    models.set_defaults(run=_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.invocation = shlex.join(["adafuse", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except (ModelLoadError, ValueError, TypeError, FileNotFoundError) as error:
        print(f"adafuse: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("adafuse: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
