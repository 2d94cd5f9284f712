"""An op whose tensors mix weight formats (a file's Q8_0 attn_v beside Q4_0 q and k) runs on
reference in every layer, and decode loses its fused step: the default placement says so once,
as a --units placement already did (it showed only in the plan's reasons)."""
import logging

from gguf import GGMLQuantizationType as QT

import edgellm
from tests.synthetic import write_tiny_model


def test_a_mixed_format_projection_on_reference_is_warned_once(tmp_path, caplog):
    p = tmp_path / "mixed.gguf"
    write_tiny_model(p, tensor_type=QT.Q4_0, tensor_types={"attn_v.weight": QT.Q8_0}, d_model=128, n_heads=4,
                     n_kv_heads=2, d_ff=224)
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        e = edgellm.load(p, threads=1)
    assert {x.op: x.unit for x in e.plan.prefill.placements}["qkv"] == "reference"
    said = [w for w in e.plan.warnings if w.startswith("op qkv: its tensors mix q4_0, q8_0, and neon")]
    assert len(said) == 1 and said[0].endswith("it runs on reference (numpy), slower")
    assert sum("op qkv: its tensors mix" in r.getMessage() for r in caplog.records) == 1
    plain = tmp_path / "plain.gguf"
    write_tiny_model(plain, tensor_type=QT.Q4_0, d_model=128, n_heads=4, n_kv_heads=2, d_ff=224)
    assert not [w for w in edgellm.load(plain, threads=1).plan.warnings if "tensors mix" in w]
