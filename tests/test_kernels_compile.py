"""Every kernel variant compiles with NVRTC for sm_80 and sm_90, on a machine without a GPU."""
from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (with nvidia-cuda-nvrtc) is not "
                    "installed: kernels cannot be compiled offline")

from _registry import OPS  # noqa: E402

from mtapply import REGISTRY, _source  # noqa: E402
from mtapply.ops import UTILITIES, AdamSpec  # noqa: E402
from mtapply.rules import library  # noqa: E402

ARCHS = ("sm_80", "sm_90")


def dtype_signatures(n_slots: int, master: bool = False) -> dict:
    """Storage dtype per slot: uniform lists, and bf16 params+grads with fp32 states; with
    master weights (the last slot), 16-bit params and grads with fp32 states and masters."""
    mixed = {f"{d}-fp32state": (d, d) + ("float32",) * (n_slots - 2) for d in ("bfloat16", "float16")}
    if master:
        return mixed
    uniform = {d: (d,) * n_slots for d in ("float32", "float16", "bfloat16", "float64")}
    return {**uniform, "bf16-fp32state": mixed["bfloat16-fp32state"]}


def compile_flag_sets(name: str) -> list:
    """The spec keyword sets of every kernel variant of an op (a row may list more than it
    tests), each with and without master weights."""
    listed = OPS[name].get("compile_flag_sets", OPS[name]["flag_sets"])
    return [dict(flags, master_weights=master) for flags in listed for master in (False, True)]


def variants():
    for name, spec_cls in REGISTRY.items():
        for flags in compile_flag_sets(name):
            spec = spec_cls(**flags)
            for sig_name, dtypes in dtype_signatures(len(spec.slots), spec.master_weights).items():
                flag_names = "+".join(k for k, v in spec.flags if v) or "plain"
                yield pytest.param(spec, dtypes, id=f"{name}-{flag_names}-{sig_name}")
    for name, spec_cls in REGISTRY.items():  # the updates that mtapply.optax's transformations take
        for mode in ("delta", "zero"):
            spec = spec_cls(**OPS[name]["flag_sets"][0]).with_param_mode(mode)
            for sig_name in ("float32", "bfloat16"):
                yield pytest.param(spec, (sig_name,) * len(spec.slots), id=f"{name}-{mode}-{sig_name}")
    for masked in (AdamSpec(decoupled_weight_decay=True, decay_mask=[True, False]),
                   AdamSpec(decoupled_weight_decay=True, decay_mask=[True, False],
                            master_weights=True),  # mtapply.optax.adamw's weight-decay mask
                   AdamSpec(decoupled_weight_decay=True, decay_mask=[0.5, 0.0],
                            lr_labels=[1, 0])):  # mtapply.optax.multi_transform's labels
        for sig_name, dtypes in dtype_signatures(len(masked.slots), masked.master_weights).items():
            variant = "+".join(k for k, v in masked.flags if v)
            yield pytest.param(masked, dtypes, id=f"adam-{variant}-{sig_name}")
    for name, spec_cls in UTILITIES.items():
        for flags in ([{"into_outputs": False}, {"into_outputs": True}] if name == "scale" else [{}]):
            spec = spec_cls(**flags)
            for sig_name, dtypes in dtype_signatures(len(spec.slots)).items():
                if len(set(dtypes)) == 1:
                    yield pytest.param(spec, dtypes, id=f"{name}-{sig_name}-{len(spec.slots)}")


def test_every_registered_op_has_a_test_row():
    assert set(REGISTRY) == set(OPS)
    for name in REGISTRY:
        assert OPS[name]["spec"] is REGISTRY[name]
        listed = compile_flag_sets(name)
        flag_keys = {tuple(k for k, _ in REGISTRY[name](**f).flags) for f in listed}
        assert len(flag_keys) == 1
        # every combination of the compile-time switches that the spec accepts is compiled
        keywords = list(listed[0])
        valid = set()
        for values in itertools.product((False, True), repeat=len(keywords)):
            try:
                valid.add(REGISTRY[name](**dict(zip(keywords, values))).flags)
            except ValueError:  # a combination the op refuses, e.g. nesterov without momentum
                pass
        assert {REGISTRY[name](**f).flags for f in listed} == valid


@pytest.mark.parametrize("spec,dtypes", list(variants()))
def test_variant_compiles(spec, dtypes):
    source = spec.source(dtypes)
    assert "#include" not in source, "headers must be inlined (CuPy's cache keys on the source text)"
    for word, count, *_ in spec.device_checks():  # each device scalar checked before the walk
        assert f"X({word}, {count}, " in source
    for name, value in spec.flags:
        assert f"#define MTA_{name} {int(value)}" in source
    for member in spec.arg_members:  # the host's packing, asserted where the kernel compiles
        assert f"(const void*)&a.{member}; }}" in source
    with ThreadPoolExecutor(len(ARCHS)) as pool:
        cubins = dict(zip(ARCHS, pool.map(lambda arch: _source.compile_offline(source, arch), ARCHS)))
    for arch, cubin in cubins.items():
        assert isinstance(cubin, bytes) and len(cubin) > 1000, arch
        assert cubin[:4] == b"\x7fELF", f"{arch}: not an ELF cubin"
        for k in range(len(spec.functors)):
            assert _source.entry_name(k).encode() in cubin, f"{arch}: entry point {k} is missing"
    assert cubins["sm_80"] != cubins["sm_90"]


ADAM8BIT_GROUPS = {"8bit": ("float32", "float32", "uint8", "uint8", "float32", "float32"),
                   "8bit-bf16": ("bfloat16", "bfloat16", "uint8", "uint8", "float32", "float32"),
                   "fp32-moments": ("float32",) * 6}


@pytest.mark.parametrize("group", list(ADAM8BIT_GROUPS))
@pytest.mark.parametrize("decoupled,maximize", [(False, False), (True, False), (True, True)])
def test_adam8bit_groups_compile(group, decoupled, maximize):
    from mtapply.ops import Adam8bitSpec

    spec = Adam8bitSpec(decoupled_weight_decay=decoupled, maximize=maximize)
    dtypes = ADAM8BIT_GROUPS[group]
    functors = spec.functors_for(dtypes)
    assert functors == (("mta::Adam8bit",) if group.startswith("8bit") else ("mta::Adam",))
    source = spec.source(dtypes)
    assert "#include" not in source and "CODE_WORDS[" in source
    cubin = _source.compile_offline(source, "sm_90", spec.compile_options(dtypes))
    assert cubin[:4] == b"\x7fELF" and _source.entry_name(0).encode() in cubin


def test_adam8bit_with_stochastic_rounding_compiles():
    from mtapply.ops import Adam8bitSpec

    spec = Adam8bitSpec(decoupled_weight_decay=True, stochastic_rounding=True)
    for dtypes in (ADAM8BIT_GROUPS["8bit-bf16"], ("bfloat16", "bfloat16") + ("float32",) * 4):
        assert len(spec.functors_for(dtypes)) >= 1
        source = spec.source(dtypes)
        assert "#define MTA_STOCHASTIC 1" in source
        assert _source.compile_offline(source, "sm_90")[:4] == b"\x7fELF"


@pytest.mark.parametrize("name,flags", [("adam", {}), ("adam", {"decoupled_weight_decay": True}),
                                        ("adam", {"amsgrad": True}), ("sgd", {}),
                                        ("sgd", {"momentum_buffers": False})])
@pytest.mark.parametrize("grads", ["bfloat16", "float32"])
def test_stochastic_rounding_variants_compile(name, flags, grads):
    spec = REGISTRY[name](stochastic_rounding=True, **flags)
    dtypes = ("bfloat16", grads) + ("float32",) * (len(spec.slots) - 2)
    source = spec.source(dtypes)
    assert "#define MTA_STOCHASTIC 1" in source and "philox4x32_10" in source
    cubin = _source.compile_offline(source, "sm_90")
    assert cubin[:4] == b"\x7fELF" and _source.entry_name(0).encode() in cubin


def test_variant_sources_differ_by_key_and_are_memoised():
    spec_cls = REGISTRY["adam"]
    sources = {}
    for flags, dtypes in itertools.product(OPS["adam"]["flag_sets"],
                                           dtype_signatures(4).values()):
        spec = spec_cls(**flags)
        dtypes = dtypes + (dtypes[-1],) * (len(spec.slots) - 4)
        source = spec.source(dtypes)
        assert source is spec.source(dtypes)
        sources[(spec.flags, dtypes)] = source
    assert len(set(sources.values())) == len(sources), "two compile keys share one source"


@pytest.mark.parametrize("dtypes", list(dtype_signatures(5).values()))
def test_chunk_is_a_multiple_of_every_vector_width(dtypes):
    # the walker keeps vectors aligned only because every chunk starts at a multiple of MTA_VEC
    assert _source.CHUNK_ELEMENTS % _source.vector_width(dtypes) == 0
    assert _source.CHUNK_ELEMENTS % 8 == 0


@pytest.mark.parametrize("change", ["header", "order", "missing"])
def test_a_host_packing_unlike_the_kernels_structs_does_not_compile(change):
    """The launch header and the op's argument words are packed by the host by name and order
    (mtapply._launch); a source whose declared packing differs from its C++ structs fails to
    compile with the differing field named."""
    from mtapply._launch import HEADER_BYTES
    from mtapply.ops import AdamSpec

    spec, dtypes = AdamSpec(), ("float32",) * 4
    header, members = HEADER_BYTES, spec.arg_members
    header, members, named = {"header": (header - 8, members, "launch header"),
                              "order": (header, members[::-1], "weight_decay is not word 0"),
                              "missing": (header, members[:-1], "differs from the op's")}[change]
    source = _source.variant_source(spec.kernel_file, spec.functors_for(dtypes), dtypes,
                                    spec.flags, spec.chunk_for(dtypes), spec.device_checks(),
                                    (header, members))
    with pytest.raises(RuntimeError, match=named):
        _source.compile_offline(source, "sm_90")


def test_broken_source_raises_with_the_compiler_log():
    spec = REGISTRY["adam"]()
    source = spec.source(("float32",) * 4)
    broken = source + "\n__device__ float mta_broken() { return undeclared_value_xyz; }\n"
    with pytest.raises(RuntimeError, match="NVRTC failed for sm_90") as info:
        _source.compile_offline(broken, "sm_90")
    assert "undeclared_value_xyz" in str(info.value) and "error" in str(info.value)


FACTORED_RULES = {"adafactor": lambda: library.adafactor(),
                  "adafactor-maximize": lambda: library.adafactor(True),
                  "adafactor_optax": lambda: library.adafactor_optax(),
                  "adafactor_optax-momentum-no-sums": lambda: library.adafactor_optax(
                      False, False, True)}


@pytest.mark.parametrize("storage", ["float32", "bfloat16-fp32state", "float64"])
@pytest.mark.parametrize("name", list(FACTORED_RULES))
def test_factored_rules_compile(name, storage):
    """Rules with factored slots: the factor and matrix reductions (kernels/factored.cuh) and
    the walker's indexed passes, with master weights and as optax's updates too."""
    rule = FACTORED_RULES[name]()
    specs = [rule.spec(), rule.spec().with_param_mode("delta")]
    if storage == "bfloat16-fp32state":
        specs.append(rule.spec(master_weights=True))
    for spec in specs:
        n = len(spec.slots)
        dtypes = {"float32": ("float32",) * n, "float64": ("float64",) * n,
                  "bfloat16-fp32state": ("bfloat16", "bfloat16") + ("float32",) * (n - 2)}[storage]
        source = spec.source(dtypes)
        assert "#include" not in source and "factor_walk<" in source
        cubin = _source.compile_offline(source, "sm_90")
        assert cubin[:4] == b"\x7fELF"
        for k in range(len(spec.functors_for(dtypes))):
            assert _source.entry_name(k).encode() in cubin


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_kernel_adding_the_totals_of_several_gpus_compiles(dtype):
    from mtapply._devices import adding_source

    cubin = _source.compile_offline(adding_source(dtype), "sm_90")
    assert cubin[:4] == b"\x7fELF" and _source.entry_name(0).encode() in cubin
