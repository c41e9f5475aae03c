"""`async-rlhf` command line.

Each subcommand lives in the module that owns it, which provides `add_arguments(parser)` and
`run(args) -> int` (or `add_<name>_arguments` and `run_<name>` where one module holds several);
this file only lists them and imports the chosen command's module alone, so `async-rlhf --help`
imports none of them (and no command module imports torch, vLLM or Ray before `run`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

# name -> (module, one-line help, function suffix or "")
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("async_rlhf.launch.launcher", "run a training job (generators + learner + Redis stream)", ""),
    "status": ("async_rlhf.launch.jobctl", "show a running job: generators, learner, queue", "status"),
    "add-generators": ("async_rlhf.launch.jobctl", "add generators to a running job", "generators"),
    "stop": ("async_rlhf.launch.jobctl", "stop a running job cleanly after its current step", "stop"),
    "init-model": ("actors.model_init", "build a random-init Llama-style model and tokenizer offline", ""),
    "bench-queue": ("async_rlhf.launch.bench.stream", "experience-stream throughput vs raw redis-py", ""),
    "bench-gen": ("async_rlhf.launch.bench.gen", "generation throughput: vLLM engine vs transformers", ""),
    "bench-learner": ("async_rlhf.launch.bench.learner", "learner throughput and time split", ""),
    "bench-memory": ("async_rlhf.launch.bench.memory", "a job's peak memory by part at real sizes, beside its estimate", ""),
    "bench": ("async_rlhf.launch.bench.jobs", "async vs sync training throughput, stage bounds, idle and staleness", ""),
    "config": ("async_rlhf.launch.cli", "print the resolved config, its JSON schema (--schema) or its reference (--reference)", "show_config"),
    "study": ("async_rlhf.launch.study", "learning under staleness: held-out reward by k and loss, over seeds", ""),
    "plot": ("async_rlhf.launch.plot", "PNGs of runs' reward, KL, entropy, length, staleness, throughput and stage times", ""),
}


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, Callable[[argparse.Namespace], int]]:
    """The arguments and the function that runs the chosen command."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="async-rlhf", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv else None  # the parser has no options of its own before COMMAND
    runners = {}
    for name, (module_name, help_text, suffix) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # only the chosen command's module is imported
            module = importlib.import_module(module_name)
            infix = f"_{suffix}" if suffix else ""
            getattr(module, f"add{infix}_arguments")(p)
            runners[name] = getattr(module, f"run{infix}")
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may come anywhere, also between flags (argparse alone wants them together)
    if extra and (not hasattr(args, "overrides") or any(t.startswith("-") or "=" not in t for t in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args, runners[args.command]


def main(argv: list[str] | None = None) -> int:
    from async_rlhf.config import ConfigError

    args, runner = parse(argv)
    try:
        return int(runner(args) or 0)
    except ConfigError as e:  # the message names the key, the value and what is allowed
        print(f"async-rlhf {args.command}: config error: {e}", file=sys.stderr)
        return 2


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The config arguments shared by commands that run a job: --config, flags, key=value."""
    parser.add_argument("--config", help="YAML config file (defaults apply to what it omits)")
    parser.add_argument("--max-staleness", type=int, help="k: max policy versions a trajectory may lag")
    parser.add_argument("--job", help="job name (Ray namespace)")
    parser.add_argument("--out", help="output directory")
    parser.add_argument("overrides", nargs="*", default=[], help="key=value overrides, e.g. learner.lr=1e-5")


def add_show_config_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--show", action="store_true", help="the config a job would run with (default)")
    what.add_argument("--schema", action="store_true", help="the config file's JSON schema")
    what.add_argument("--reference", action="store_true",
                      help="every key with type, default, allowed values and meaning, as Markdown (docs/config.md)")


def run_show_config(args: argparse.Namespace) -> int:
    if args.reference:
        from async_rlhf.config_doc import reference

        print(reference(), end="")
    elif args.schema:
        import json

        from async_rlhf.config import Config

        print(json.dumps(Config.json_schema(), indent=2))
    else:
        print(config_from_args(args).to_yaml(), end="")
    return 0


def int_list(text: str, name: str) -> list[int]:
    """The integers >= 0 of a comma list given as --NAME (bench, study)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--{name} must be a comma list of integers, e.g. 0,1,2, got {text!r}") from None
    if not values or min(values) < 0:
        raise SystemExit(f"--{name} must list integers >= 0, got {text!r}")
    return values


def config_from_args(args: argparse.Namespace):
    from async_rlhf.config import load_config

    overrides = list(args.overrides)
    for flag, key in (("max_staleness", "max_staleness"), ("job", "job"), ("out", "out")):
        if getattr(args, flag, None) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    return load_config(args.config, overrides)


if __name__ == "__main__":
    sys.exit(main())
