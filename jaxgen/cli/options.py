"""What the `jaxgen` commands share: the engine's flags, generated from its config fields
(`engine.config`: each field's flag, type, default, choices and help text come from its
declaration, so the command line, `LLM(...)` and the engine read one list), the sampling flags,
and the engine a command builds from them. Importing this module imports no JAX."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from jaxgen.engine.config import SECTIONS, JaxgenConfig, SpeculativeConfig
from jaxgen.entrypoints.tool_calls import FORMATS

ENGINE_SECTIONS = tuple(SECTIONS)  # every section an engine command offers as flags


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default."""


def command(sub, name: str, help: str, description: str) -> argparse.ArgumentParser:
    """A subcommand's parser."""
    return sub.add_parser(name, help=help, description=description, formatter_class=HelpFormatter)


def flag(field: dataclasses.Field) -> str:
    return field.metadata.get("flag", "--" + field.name.replace("_", "-"))


def dest(section: type, field: dataclasses.Field) -> str:
    """A field's attribute on the parsed arguments (the speculative section's are prefixed:
    its `model` is the draft model, not the engine's)."""
    return f"speculative_{field.name}" if section is SpeculativeConfig else field.name


def _add_field(group, section: type, field: dataclasses.Field, hint) -> None:
    meta = field.metadata
    kwargs = dict(dest=dest(section, field), default=field.default, help=meta["help"])
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    base = meta.get("type") or next(a for a in args if a is not type(None))
    if typing.get_origin(base) is tuple:  # a list of names
        base, kwargs["nargs"] = str, "+"
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = base
        if "choices" not in meta:
            kwargs["metavar"] = flag(field)[2:].upper().replace("-", "_")
        for key in ("choices", "metavar", "nargs"):
            if key in meta:
                kwargs[key] = meta[key]
    group.add_argument(flag(field), **kwargs)


def add_config_args(parser, sections=ENGINE_SECTIONS, *, only=None, speculative=True) -> None:
    """One argument group per config section, a flag per field (`only`: just these fields);
    `speculative`: the speculative-decoding section too (off unless --speculative names a
    drafter)."""
    chosen = [SECTIONS[key] for key in sections]
    if speculative:
        chosen.append(SpeculativeConfig)
    for section in chosen:
        hints = typing.get_type_hints(section)
        fields = [f for f in dataclasses.fields(section) if only is None or f.name in only]
        if not fields:
            continue
        group = parser.add_argument_group(f"{section.__name__} (jaxgen.engine.config)")
        for field in fields:
            _add_field(group, section, field, hints[field.name])
    if speculative:
        parser.set_defaults(speculative_method=None)  # no drafter unless one is named
    # A command owns its process: JAX's persistent compilation cache is on there.
    parser.set_defaults(compilation_cache=True)


def llm_options(args, **overrides) -> dict:
    """The engine options the parsed flags give, by field name (`LLM(**options)`; what each Ray
    replica of `jaxgen batch --ray` builds its engine with), `overrides` over them."""
    options = {
        field.name: getattr(args, field.name)
        for section in SECTIONS.values()
        for field in dataclasses.fields(section)
        if hasattr(args, field.name)
    }
    if getattr(args, "speculative_method", None) is not None:
        options["speculative"] = {
            field.name: getattr(args, dest(SpeculativeConfig, field))
            for field in dataclasses.fields(SpeculativeConfig)
        }
    options.update(overrides)
    return options


def engine_config(args, **overrides) -> JaxgenConfig:
    """The `JaxgenConfig` of the parsed flags, `overrides` over them."""
    return JaxgenConfig.from_options(**llm_options(args, **overrides))


def make_llm(args, distributed: bool = True, **overrides):
    """The engine of a command. With `distributed`, --coordinator joins a multi-process SPMD
    job (one global mesh); batch jobs instead split their lines by rank and keep each
    process's mesh on its own devices."""
    from jaxgen import LLM
    from jaxgen.sharding.distributed import initialize

    config = engine_config(args, **overrides)  # checked before anything starts
    if distributed:
        initialize(args.coordinator, args.num_processes, args.process_id)
    return LLM(config=config)


def add_engine_args(p: argparse.ArgumentParser, speculative: bool = True) -> None:
    """What the commands that run the engine (generate, chat, serve, batch) take: every engine
    option, and the multi-host flags of the process."""
    add_config_args(p, speculative=speculative)
    g = p.add_argument_group("multi-host (jax.distributed; gloo on CPU)")
    g.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
    g.add_argument("--num-processes", type=int, default=None, help="processes in the job")
    g.add_argument("--process-id", type=int, default=None, help="this process's index")


def add_tool_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(FORMATS),
        help="how the model writes tool calls (default: the format its chat template shows; "
        "hermes when it shows none)",
    )


def add_sampling_args(p: argparse.ArgumentParser, *, several: bool = True) -> None:
    """Sampling flags (the engine's --seed seeds them too); `several`: also --n and --logprobs
    (commands that print completions)."""
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="new tokens at most")
    g.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        help="new tokens before a stop may end the output",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest (-1 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="0 = off")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="0 = off")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    if several:
        g.add_argument("--n", type=int, default=1, help="completions per prompt")
        g.add_argument(
            "--logprobs",
            type=int,
            default=None,
            help="show each token's logprob and its N likeliest alternatives",
        )


def sampling_params(args):
    from jaxgen import SamplingParams

    return SamplingParams(
        n=getattr(args, "n", 1),
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        stop=args.stop,
        seed=args.seed,
        logprobs=getattr(args, "logprobs", None),
    )
