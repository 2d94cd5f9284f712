"""edgellm's GGUF type tables (model/ggml_types.py, so that a load does not import the `gguf`
package) against the package's: same codes, names and block sizes for every type both know."""
import gguf

from edgellm.model import ggml_types as ours


def test_tensor_types_and_block_sizes_match_the_gguf_package():
    theirs = {t.name: int(t) for t in gguf.GGMLQuantizationType}
    mine = {t.name: int(t) for t in ours.GGMLQuantizationType}
    common = theirs.keys() & mine.keys()
    assert {n: mine[n] for n in common} == {n: theirs[n] for n in common}
    # everything edgellm reads or writes is in both
    assert {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"} <= common
    for name in common:
        t = ours.GGMLQuantizationType[name]
        assert ours.GGML_QUANT_SIZES.get(t) == gguf.GGML_QUANT_SIZES.get(gguf.GGMLQuantizationType[name]), name
        # members interchange: equal, same hash, so either indexes the other's tables
        assert t == gguf.GGMLQuantizationType[name] and hash(t) == hash(gguf.GGMLQuantizationType[name])


def test_value_types_match_the_gguf_package():
    assert {t.name: int(t) for t in ours.GGUFValueType} == {t.name: int(t) for t in gguf.GGUFValueType}
