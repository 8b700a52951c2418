"""The family registry (`strata_jax.models.registry`): every registered architecture resolves to its family file's
``FAMILY``; an unknown architecture is refused with one error naming the supported ones; the engine and the draft
model check read the family (not an architecture list)."""

from pathlib import Path

import pytest

from strata_jax.errors import UnsupportedError
from strata_jax.gguf import open_gguf
from strata_jax.models import registry
from strata_jax.models.family import Family

FIX = Path(__file__).parent / "fixtures" / "hybrid"


def test_every_registered_family_loads():
    for arch in registry.supported_archs():
        fam = registry.get_family(arch)
        assert isinstance(fam, Family) and fam.arch == arch
        assert callable(fam.read_config) and callable(fam.stage)
    assert set(registry.recurrent_archs()) <= set(registry.supported_archs())
    assert "qwen4exp" in registry.recurrent_archs() and "llama" not in registry.recurrent_archs()


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(UnsupportedError) as e:
        registry.get_family("bert", "m.gguf")
    msg = str(e.value)
    assert msg.startswith("m.gguf: unsupported architecture 'bert' (supported: ")
    for arch in registry.supported_archs():
        assert arch in msg


def test_config_is_read_by_the_family():
    g = open_gguf(FIX / "qwen3next_q8_0.gguf")
    cfg = registry.config_from_gguf(g)
    assert cfg == registry.family_of(g).read_config(g)
    assert cfg.arch == "qwen3next" and cfg.v_order == "grouped" and cfg.n_expert == 8


def test_mtp_head_of_a_family_without_one():
    class Cfg:
        arch = "llama"

    with pytest.raises(UnsupportedError, match="no MTP draft layer for architecture 'llama'"):
        registry.mtp_head(None, Cfg())


def test_rope_scaling_is_refused():
    """qwen3 / qwen3moe / qwen35 files asking for RoPE scaling (YaRN) are refused by their key reading, before any
    tensor is read."""

    class G:
        path = "m.gguf"

        def __init__(self, arch):
            self.architecture = arch
            self.metadata = {"general.architecture": arch, f"{arch}.rope.scaling.type": "yarn"}

    for arch in ("qwen3", "qwen3moe", "qwen35"):
        with pytest.raises(UnsupportedError, match=f"m.gguf: RoPE scaling 'yarn' \\({arch}.rope.scaling.type\\)"):
            registry.get_family(arch).read_config(G(arch))
