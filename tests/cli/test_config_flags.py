"""One configuration: the engine's config fields, `LLM(...)`'s keywords and the command line's
flags are one list (`engine.config`, `cli.options`)."""

import argparse
import dataclasses

import pytest

from jaxgen.cli.main import build_parser
from jaxgen.cli.options import dest, engine_config, flag
from jaxgen.engine.config import SECTIONS, JaxgenConfig, SpeculativeConfig

ENGINE_COMMANDS = {"generate": [], "chat": [], "serve": [], "batch": ["in.jsonl", "out.jsonl"]}
SECTION_CLASSES = [*SECTIONS.values(), SpeculativeConfig]


def _subparsers():
    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices


def _config_flags(parser) -> set[str]:
    """The flags of a parser's config argument groups."""
    return {
        s
        for group in parser._action_groups
        if group.title and group.title.endswith("(jaxgen.engine.config)")
        for a in group._group_actions
        for s in a.option_strings
        if not s.startswith("--no-")
    }


def _field_flags() -> set[str]:
    return {flag(f) for section in SECTION_CLASSES for f in dataclasses.fields(section)}


def test_every_config_field_has_a_flag_and_every_flag_a_field():
    commands = _subparsers()
    for name in ENGINE_COMMANDS:
        assert _config_flags(commands[name]) == _field_flags(), name
    # No option of an engine command outside the config groups is an engine option: the
    # command's own flags (prompts, output, server address, sampling, multi-host) only.
    names = {f.name for section in SECTION_CLASSES for f in dataclasses.fields(section)}
    for name in ENGINE_COMMANDS:
        p = commands[name]
        config_dests = {dest(s, f) for s in SECTION_CLASSES for f in dataclasses.fields(s)}
        own = {a.dest for a in p._actions if a.option_strings and a.dest not in config_dests}
        assert not own & names - {"seed"}, (name, own & names)


def test_flag_defaults_are_the_config_defaults():
    """Parsing no flags gives the default config, but for the one difference a command makes on
    purpose: it owns its process, so JAX's persistent compilation cache is on."""
    parser = build_parser()
    for name, positional in ENGINE_COMMANDS.items():
        args = parser.parse_args([name, *positional])
        config = engine_config(args)
        expected = JaxgenConfig.from_options(compilation_cache=True)
        if name == "batch":  # a resumable job: its sampling (and the engine's) is seeded
            expected = JaxgenConfig.from_options(expected, seed=0)
        assert config == expected, name


def _other_value(action):
    """A value for a flag other than its default, of its type."""
    if action.choices:
        return next(c for c in action.choices if c != action.default)
    if isinstance(action, argparse.BooleanOptionalAction):
        return not action.default
    if action.nargs == "+":
        return ("q_proj", "v_proj")
    if action.type in (int, float):
        return action.type((action.default or 0) + 3)
    return "x"


@pytest.mark.parametrize("section", SECTION_CLASSES, ids=lambda s: s.__name__)
def test_each_flag_reaches_its_config_field(section):
    """Every flag, given a value other than its default, sets that field of the config the
    command builds (and nothing else moves)."""
    parser = build_parser()
    actions = {a.dest: a for a in _subparsers()["generate"]._actions}
    for field in dataclasses.fields(section):
        if field.name in ("compilation_cache",):  # the command's default differs (above)
            continue
        value = _other_value(actions[dest(section, field)])
        if section is SpeculativeConfig and field.name == "method":
            value = "mtp"
        if isinstance(value, bool):
            argv = [flag(field) if value else "--no-" + flag(field)[2:]]
        elif isinstance(value, tuple):
            argv = [flag(field), *value]
        else:
            argv = [flag(field), str(value)]
        if section is SpeculativeConfig and field.name != "method":
            argv += ["--speculative", "ngram"]
        config = engine_config(parser.parse_args(["generate", *argv]))
        if section is SpeculativeConfig:
            got = getattr(config.speculative, field.name)
        else:
            key = next(k for k, s in SECTIONS.items() if s is section)
            got = getattr(getattr(config, key), field.name)
        assert got == value, (section.__name__, field.name, argv)


def test_unknown_options_name_the_closest():
    with pytest.raises(TypeError, match="max_num_seqs"):
        JaxgenConfig.from_options(max_num_seq=4)
    config = JaxgenConfig.from_options(
        max_num_seqs=4, kv_cache_dtype="int8", speculative={"method": "ngram"}
    )
    assert config.scheduler.max_num_seqs == 4 and config.cache.kv_cache_dtype == "int8"
    assert config.speculative == SpeculativeConfig(method="ngram")
    # `base` keeps what it had; the options go over it.
    assert JaxgenConfig.from_options(config, page_size=8).scheduler.max_num_seqs == 4


def test_field_names_are_unique_and_lists_match_their_owners():
    from jaxgen.cache.block_manager import EVICTION_POLICIES
    from jaxgen.engine.config import ATTN_IMPLS
    from jaxgen.pallas_kernels.dispatch import IMPLS

    names = [f.name for s in SECTIONS.values() for f in dataclasses.fields(s)]
    assert len(names) == len(set(names))
    assert set(ATTN_IMPLS) == set(IMPLS)
    cache_fields = {f.name: f for f in dataclasses.fields(SECTIONS["cache"])}
    assert tuple(cache_fields["kv_eviction_policy"].metadata["choices"]) == EVICTION_POLICIES


@pytest.mark.parametrize(
    "options, error",
    [
        (dict(kv_cache="contiguous", kv_host_cache_bytes=1), "need kv_cache='paged'"),
        (dict(kv_cache="contiguous", kv_disk_cache_bytes=5), "need kv_cache='paged'"),
        (dict(enable_lora=True, max_loras=0), "max_loras must be an int >= 1"),
        (dict(batch_invariant=True, mesh="tp=2"), "paged engine on one device"),
        (dict(kv_cache="contiguous", enable_lora=True), "LoRA adapters run in the paged engine"),
        (dict(kv_cache="contiguous", speculative={"method": "ngram"}), "paged engine"),
        (dict(cover_new_shapes=0.5), "cover_new_shapes must be 0"),
        (dict(compile_buckets="decode:x"), "bad compile bucket"),
        (dict(kv_eviction_policy="mru"), "use one of"),
    ],
)
def test_validate_says_what_to_change(options, error):
    with pytest.raises(ValueError, match=error):
        JaxgenConfig.from_options(**options).validate()


def test_options_of_a_feature_that_is_off_are_not_checked():
    """As before the configs: LoRA's options count only with enable_lora."""
    JaxgenConfig.from_options(max_loras=0, lora_target_modules=["lm_head"]).validate()
