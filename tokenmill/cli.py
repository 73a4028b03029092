"""Command line: ``tokenmill serve | router | generate | chat | models | show | bench | estimate``.

Bad input prints one line to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.config import EngineArgs
from tokenmill.embedded import DEFAULT_MODEL

if TYPE_CHECKING:
    from tokenmill.host.config import HostConfig
    from tokenmill.recipes import Recipe

# tokenmill chat's cap on a reply: ends what a base model would continue forever.
CHAT_MAX_TOKENS = 512
# tokenmill generate's sampling where neither its flags nor a created model's PARAMETERs say.
GENERATE_DEFAULTS = {"max_tokens": 128, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
                     "min_p": 0.0, "repetition_penalty": 1.0}  # fmt: skip
THINKING_HELP = (
    "a reasoning model's thinking ends after N tokens: its </think> is forced there, then it "
    "answers (default: no budget)"
)


def add_declared_flags(parser: argparse.ArgumentParser, settings: type) -> None:
    """A flag for each field of the dataclass ``settings`` declared with config.option (its
    help, choices, metavar, flag name), so CLI and Python API never drift apart; the dataclass
    checks the values it is built with (``declared_values``)."""
    for f in dataclasses.fields(settings):
        meta, default = f.metadata, f.default
        if "help" not in meta or f.name == "model":
            continue
        help_text = meta["help"]
        if "(default:" not in help_text:
            help_text += f" (default: {default})"
        kwargs: dict = {"dest": f.name, "default": default, "help": help_text}
        if f.type in ("bool", "bool | None"):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif meta["choices"] is not None:
            kwargs |= {"choices": meta["choices"], "type": type(meta["choices"][-1])}
        elif f.type.startswith(("int", "float")):
            kwargs["type"] = float if f.type.startswith("float") else int
        if meta["metavar"]:
            kwargs["metavar"] = meta["metavar"]
        parser.add_argument(meta["flag"] or "--" + f.name.replace("_", "-"), **kwargs)


def declared_values(ns: argparse.Namespace, settings: type) -> dict:
    """The values of ``settings``' declared flags in ``ns`` (add_declared_flags)."""
    return {
        f.name: getattr(ns, f.name) for f in dataclasses.fields(settings) if "help" in f.metadata
    }


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The model, then a flag per EngineArgs field (its declaration: config.option)."""
    model = next(f for f in dataclasses.fields(EngineArgs) if f.name == "model")
    parser.add_argument("model", nargs="?", default=model.default, help=model.metadata["help"])
    add_declared_flags(parser, EngineArgs)
    parser.add_argument(  # the short spelling vLLM users know
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="same as --no-enable-prefix-caching",
    )


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    kwargs = {name: getattr(ns, name) for name in EngineArgs.field_names()}
    kv = kwargs["kv_cache_memory"]
    if isinstance(kv, str):
        # A bare number is bytes or a fraction; a unit string like '2GiB' goes to parse_memory.
        with contextlib.suppress(ValueError):
            kwargs["kv_cache_memory"] = float(kv) if "." in kv else int(kv)
    return EngineArgs(**kwargs)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``tokenmill serve`` beyond the engine's: ServerConfig's declared fields,
    and those of a shape of their own (keys, the model's name, the queue, prices)."""
    from tokenmill.server.config import ServerConfig

    add_declared_flags(parser, ServerConfig)
    d = ServerConfig(served_model_name="-")
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accepted API key (repeatable); without one, no key is needed",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: MODEL)"
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=d.max_queue,
        help="requests that may wait beyond --max-num-seqs running ones; more get 429 "
        f"(default: {d.max_queue}; -1: no limit)",
    )
    for name, what in (("input", "prompt"), ("output", "completion")):
        parser.add_argument(
            f"--price-{name}-per-million",
            type=float,
            default=0.0,
            help=f"USD per million {what} tokens, for usage cost (default: 0)",
        )
    parser.add_argument(
        "--price-cached-input-per-million",
        type=float,
        default=None,
        help="USD per million cached prompt tokens (default: as other prompt tokens)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine")
    parser.add_argument(
        "--log-level", default=None, help="logging level (default: INFO for serve, else WARNING)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (streaming, metrics)")
    add_engine_args(serve)
    add_server_args(serve)
    serve.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="N replicas of this server on ports PORT+1..PORT+N behind a prefix-aware router "
        "on PORT (default: 1, no router)",
    )
    # Without a model, serve is the host of every model here (host/); these are its own.
    serve.set_defaults(model=None)
    many = serve.add_argument_group("without a model: every model here, each loaded on demand")
    many.add_argument(
        "--keep-alive",
        default="5m",
        help="how long an idle model stays loaded when a request does not say (Ollama's "
        "keep_alive: '5m', '1h', seconds; 0: unload at once; negative: forever)",
    )
    many.add_argument("--max-loaded-models", type=int, default=3, metavar="N",
                      help="most models loaded at once (default: 3)")  # fmt: skip
    many.add_argument(
        "--memory-budget",
        default=None,
        help="memory the loaded models may take, e.g. '16GiB' (default: the machine's memory "
        "less 10%% and at least 1 GiB)",
    )
    from tokenmill.router.args import add_router_parser

    add_router_parser(sub)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    # Unset: a created model's PARAMETERs, else GENERATE_DEFAULTS (_generate).
    gen.add_argument("--max-tokens", type=int, default=None, help="default: 128")
    gen.add_argument(
        "--max-thinking-tokens", type=int, default=None, metavar="N", help=THINKING_HELP
    )
    gen.add_argument("--temperature", type=float, default=None, help="default: 0 (greedy)")
    gen.add_argument("--top-p", type=float, default=None, help="default: 1")
    gen.add_argument("--top-k", type=int, default=None, help="default: -1 (all)")
    gen.add_argument("--min-p", type=float, default=None, help="default: 0")
    gen.add_argument("--repetition-penalty", type=float, default=None, help="default: 1")
    gen.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        help="seed of this request's sampling (same seed, same text)",
    )
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    fmt = gen.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", metavar="FILE", help="output JSON valid under this schema")
    fmt.add_argument("--regex", help="output that fully matches this regex")
    fmt.add_argument("--choice", action="append", help="output one of these (repeatable)")
    fmt.add_argument("--grammar", metavar="FILE", help="output of this Lark or GBNF grammar")

    chat = sub.add_parser("chat", help="chat with the model in the terminal (Ctrl-D leaves)")
    add_engine_args(chat)
    chat.add_argument("--system", default=None, help="system message")
    # Unset: a created model's PARAMETERs, else these defaults (_chat).
    chat.add_argument("--temperature", type=float, default=None, help="default: 0.7")
    chat.add_argument("--top-p", type=float, default=None, help="default: 0.9")
    chat.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"most tokens a reply (default: {CHAT_MAX_TOKENS}, so the prompt comes back even "
        "from a model that does not stop; /params max_tokens=N changes it)",
    )
    chat.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampling")
    chat.add_argument(
        "--max-thinking-tokens", type=int, default=None, metavar="N", help=THINKING_HELP
    )

    create = sub.add_parser("create", help="name a model made from a Modelfile (Ollama's)")
    create.add_argument("name", help="the new model's name")
    create.add_argument(
        "-f", "--file", default="Modelfile", help="the Modelfile (default: ./Modelfile)"
    )
    models = sub.add_parser("models", help="list the models here (alias, architecture, size)")
    models.add_argument("--model-dir", default=None, help="default: ~/.cache/tokenmill/models")
    show = sub.add_parser("show", help="a model's metadata, template and memory needs")
    show.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="alias, .gguf or HF dir")
    show.add_argument("--model-dir", default=None, help="default: ~/.cache/tokenmill/models")
    show.add_argument("--max-model-len", type=int, default=None, help="context for the KV size")

    from tokenmill.bench.cli import add_bench_parser

    add_bench_parser(sub, add_engine_args)
    from tokenmill.bench.estimate import add_estimate_parser

    add_estimate_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    ns = parser.parse_args(raw_argv)
    log_level = ns.log_level or ("INFO" if ns.command in ("serve", "router") else "WARNING")
    logging.basicConfig(
        level=getattr(logging, str(log_level).upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if ns.command == "serve":
            if ns.model is None and ns.data_parallel_size == 1:
                return _serve_host(ns, raw_argv, str(log_level).lower())
            if ns.model is None:  # the replicas serve the default model
                ns.model = DEFAULT_MODEL
                at = raw_argv.index("serve") + 1
                raw_argv = [*raw_argv[:at], DEFAULT_MODEL, *raw_argv[at:]]
            if ns.data_parallel_size != 1:
                return _serve_data_parallel(ns, raw_argv, str(log_level).lower())
            return _serve(ns, str(log_level).lower())
        if ns.command == "router":
            from tokenmill.router.args import run_router_command

            return run_router_command(ns, str(log_level).lower())
        if ns.command == "generate":
            return _generate(ns)
        if ns.command == "chat":
            return _chat(ns)
        if ns.command in ("models", "show"):
            return _models(ns)
        if ns.command == "create":
            return _create(ns)
        if ns.command == "estimate":
            from tokenmill.bench.estimate import run_estimate

            return run_estimate(ns)
        if ns.command == "bench":
            from tokenmill.bench.cli import run_bench

            return run_bench(ns, engine_args_from)  # serve builds no engine
    except ValueError as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {ns.command}")
    return 2


def _serve(ns: argparse.Namespace, log_level: str) -> int:
    from tokenmill.cost import TokenPrices
    from tokenmill.server.config import ServerConfig
    from tokenmill.server.launcher import run_server

    recipe = _recipe_of(ns)  # its SYSTEM, MESSAGEs and PARAMETERs: the server applies them
    engine_args = engine_args_from(ns)
    config = ServerConfig(
        recipe=recipe,
        served_model_name=ns.served_model_name or ns.model,
        api_keys=tuple(ns.api_key),
        max_queue=None if ns.max_queue is not None and ns.max_queue < 0 else ns.max_queue,
        prices=TokenPrices(
            ns.price_input_per_million,
            ns.price_output_per_million,
            ns.price_cached_input_per_million,
        ),
        **declared_values(ns, ServerConfig),
    )
    return run_server(engine_args, config, log_level)


def _create(ns: argparse.Namespace) -> int:
    """``tokenmill create NAME -f Modelfile``: the model is named in aliases.toml."""
    from tokenmill import recipes
    from tokenmill.embedded import EMBEDDED_MODELS
    from tokenmill.resolve import resolve_model

    file = Path(ns.file)
    try:
        text = file.read_text()
    except OSError as e:
        raise ValueError(f"cannot read the Modelfile {str(file)!r}: {e.strerror}") from None
    recipe = recipes.parse_modelfile(ns.name, text)
    base = recipe.base
    if base.startswith(("./", "../", "/", "~")) or base.endswith(".gguf"):
        path = Path(base).expanduser()  # a path: relative to the Modelfile, as Ollama reads it
        base = str(path if path.is_absolute() else (file.parent / path).resolve())
    if base not in EMBEDDED_MODELS:
        resolve_model(base)  # an unknown base is an error now, not at the first request
    recipes.save(dataclasses.replace(recipe, base=base))
    print(f"created {recipe.name} (from {base})")
    return 0


def _serve_host(ns: argparse.Namespace, raw_argv: list[str], log_level: str) -> int:
    """``tokenmill serve`` without a model: every model here, loaded on demand (host/)."""
    import tempfile

    from tokenmill.host.launcher import run_host
    from tokenmill.server.usage import UsageStore

    if ns.served_model_name:
        raise ValueError("--served-model-name names a pinned model: give the model too")
    # The flags every runner checks, checked here first: a mistake stops the host at once.
    engine_args_from(argparse.Namespace(**{**vars(ns), "model": DEFAULT_MODEL}))
    with tempfile.TemporaryDirectory(prefix="tokenmill-host-") as scratch:
        # Without --usage-db, one file for the host's life that its runners share.
        usage_db = ns.usage_db or str(Path(scratch) / "usage.sqlite")
        UsageStore(usage_db).close()
        return run_host(_host_config(ns, raw_argv, usage_db), log_level)


def _host_config(ns: argparse.Namespace, raw_argv: list[str], usage_db: str) -> HostConfig:
    from tokenmill.config.cache import parse_memory
    from tokenmill.host.config import HostConfig
    from tokenmill.host.keep_alive import parse_keep_alive
    from tokenmill.memory import total_memory

    kv = parse_memory(ns.kv_cache_memory) if ns.kv_cache_memory is not None else 512 * 2**20
    if not isinstance(kv, int):
        raise ValueError("without a model, --kv-cache-memory must be bytes (e.g. '512MiB'): a "
                         "fraction would depend on which models loaded first")  # fmt: skip
    if ns.memory_budget is not None:
        budget = parse_memory(ns.memory_budget)
        if not isinstance(budget, int):
            raise ValueError(
                f"--memory-budget must be bytes (e.g. '16GiB'); got {ns.memory_budget}"
            )
    else:
        total = total_memory() or 8 * 2**30
        budget = max(total - max(total // 10, 2**30), 2**30)
    at = raw_argv.index("serve") + 1
    runner_args = _without(raw_argv[at:], HOST_ONLY_FLAGS)
    keys = (*ns.api_key, *([ns.admin_api_key] if ns.admin_api_key else []))
    return HostConfig(
        runner_args=(*runner_args, "--usage-db", usage_db),
        host=ns.host,
        port=ns.port,
        api_keys=tuple(keys),
        admin_api_key=ns.admin_api_key,
        max_loaded_models=ns.max_loaded_models,
        memory_budget=budget,
        keep_alive=parse_keep_alive(ns.keep_alive),
        kv_cache_memory=kv,
        stop_timeout=ns.shutdown_timeout + 15,
        metrics_public=ns.metrics_public,
        access_log=ns.access_log,
    )


# The host's own flags (with how many values each takes): its runners get the rest.
HOST_ONLY_FLAGS = {"--host": 1, "--port": 1, "--keep-alive": 1, "--max-loaded-models": 1,
                   "--memory-budget": 1, "--kv-cache-memory": 1}  # fmt: skip


def _without(argv: list[str], flags: dict[str, int]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, _ = argv[i].partition("=")
        if name in flags:
            i += 1 if eq else 1 + flags[name]
            continue
        out.append(argv[i])
        i += 1
    return out


def _serve_data_parallel(ns: argparse.Namespace, raw_argv: list[str], log_level: str) -> int:
    from tokenmill.router.config import RouterConfig
    from tokenmill.router.launcher import run_data_parallel

    if ns.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1; got {ns.data_parallel_size}")
    keys = (*ns.api_key, *([ns.admin_api_key] if ns.admin_api_key else []))
    router = RouterConfig(
        replica_urls=("http://-",),  # replaced by the launched replicas' URLs
        host=ns.host,
        port=ns.port,
        api_keys=tuple(keys),
        metrics_public=ns.metrics_public,
        access_log=ns.access_log,
    )
    return run_data_parallel(
        raw_argv, ns.data_parallel_size, router, ns.shutdown_timeout, ns.num_threads, log_level
    )


def _structured_outputs(ns: argparse.Namespace):
    from tokenmill.sampling_params import StructuredOutputs

    def read(path: str, flag: str) -> str:
        try:
            return Path(path).read_text()
        except OSError as e:
            raise ValueError(f"{flag}: cannot read {path!r}: {e.strerror}") from None

    if ns.json_schema:
        return StructuredOutputs(json=read(ns.json_schema, "--json-schema"))
    if ns.grammar:
        return StructuredOutputs(grammar=read(ns.grammar, "--grammar"))
    if ns.regex is not None:
        return StructuredOutputs(regex=ns.regex)
    if ns.choice:
        return StructuredOutputs(choice=ns.choice)
    return None


def _recipe_of(ns: argparse.Namespace) -> Recipe | None:
    """The Modelfile of a created model ``ns.model`` names (none for a path or a plain model);
    its TEMPLATE becomes the chat template unless --chat-template says otherwise."""
    from tokenmill.recipes import recipes

    recipe = recipes().get(ns.model.removesuffix(":latest")) if "/" not in ns.model else None
    if recipe is not None and recipe.template is not None and ns.chat_template is None:
        ns.chat_template = recipe.template
    return recipe


def _generate(ns: argparse.Namespace) -> int:
    from tokenmill.engine import LLMEngine
    from tokenmill.sampling_params import SamplingParams

    recipe = _recipe_of(ns)
    given = {
        "max_tokens": ns.max_tokens,
        "temperature": ns.temperature,
        "top_p": ns.top_p,
        "top_k": ns.top_k,
        "min_p": ns.min_p,
        "repetition_penalty": ns.repetition_penalty,
        "seed": ns.sampling_seed,
        "stop": ns.stop or None,
    }
    settings = dict(GENERATE_DEFAULTS)
    settings |= recipe.openai_defaults() if recipe is not None else {}
    settings |= {k: v for k, v in given.items() if v is not None}
    if isinstance(settings.get("stop"), str):
        settings["stop"] = [settings["stop"]]
    params = SamplingParams(
        **settings,
        ignore_eos=ns.ignore_eos,
        structured_outputs=_structured_outputs(ns),
        max_thinking_tokens=ns.max_thinking_tokens,
    )
    if not ns.prompt:
        raise ValueError("--prompt must not be empty")
    engine = LLMEngine(engine_args_from(ns))
    if ns.chat:
        messages = [{"role": "system", "content": ns.system}] if ns.system else []
        messages.append({"role": "user", "content": ns.prompt})
        if recipe is not None:  # its SYSTEM (unless --system) and MESSAGEs
            messages = recipe.conversation(messages)
        prompt: str | list[int] = engine.tokenizer.encode_chat(messages)
    else:
        prompt = ns.prompt
    start = time.monotonic()
    engine.add_request(prompt, params)
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].text_delta)
            sys.stdout.flush()
            last = out
    sys.stdout.write("\n")
    if last is not None:
        m = last.metrics
        n = m.num_generation_tokens
        decode_time = (m.finished_time or start) - (m.first_token_time or start)
        rate = (n - 1) / decode_time if n > 1 and decode_time > 0 else 0.0
        print(
            f"[{m.num_prompt_tokens} prompt tokens, {n} generated, TTFT {m.ttft * 1000:.0f} ms, "
            f"{rate:.1f} tokens/s, finish: {last.outputs[0].finish_reason}]",
            file=sys.stderr,
        )
    return 0


def _models(ns: argparse.Namespace) -> int:
    import os

    from tokenmill.entrypoints.models import print_models, print_show

    if ns.model_dir:  # read by resolve_model too
        os.environ["TOKENMILL_MODEL_DIR"] = ns.model_dir
    if ns.command == "models":
        print_models(sys.stdout, Path(ns.model_dir) if ns.model_dir else None)
    else:
        print_show(sys.stdout, ns.model, ns.max_model_len)
    return 0


def _chat(ns: argparse.Namespace) -> int:
    from tokenmill.engine import LLMEngine
    from tokenmill.entrypoints.chat import PARAMS, run_chat

    # A model made from a Modelfile: its SYSTEM, MESSAGEs and PARAMETERs, where the command
    # line sets none.
    recipe = _recipe_of(ns)
    engine = LLMEngine(engine_args_from(ns))
    if engine.tokenizer.chat_template is None:
        raise ValueError(f"{ns.model!r} has no chat template; use tokenmill generate")
    if ns.max_thinking_tokens is not None and engine.reasoning is None:
        raise ValueError(f"--max-thinking-tokens needs a reasoning model; {ns.model!r} is not one")
    given = {
        "temperature": ns.temperature,
        "top_p": ns.top_p,
        "max_tokens": ns.max_tokens,
        "seed": ns.sampling_seed,
        "max_thinking_tokens": ns.max_thinking_tokens,
    }
    own = recipe.openai_defaults() if recipe is not None else {}
    settings = {"temperature": 0.7, "top_p": 0.9, "max_tokens": CHAT_MAX_TOKENS}
    settings |= {k: v for k, v in own.items() if k in PARAMS}
    settings |= {k: v for k, v in given.items() if v is not None}
    system = ns.system if ns.system is not None else (recipe.system if recipe else None)
    turns = list(recipe.messages) if recipe is not None else []
    return run_chat(engine, system, settings, turns)


if __name__ == "__main__":
    sys.exit(main())
