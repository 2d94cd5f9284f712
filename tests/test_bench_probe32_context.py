"""`edgellm bench` whose runs need more context than the model has names the flag that asks
for it: an 8000-token --shared-prefix on an 8192-token model was blamed on --prompt-tokens
("shorten --prompt-tokens", given 16) (a probe)."""
import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm.cli import app

from .cli_checks import one_line_error
from .synthetic import write_tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ctx") / "tiny.gguf", tensor_type=QT.Q8_0, seed=3,
                            context_length=256).path


@pytest.mark.parametrize("args, says", [
    (["--shared-prefix", "300", "--prompt-tokens", "8"],
     "need 404 tokens of context (--shared-prefix 300 + --prompt-tokens 8 + --gen-tokens 64 + 32 of margin) but "),
    (["--shared-prefix", "16", "--prompt-tokens", "8", "--gen-tokens", "400"], "shorten --gen-tokens (at most 200 "),
    (["--shared-prefix", "200", "--prompt-tokens", "8"], "holds 256, its trained context: shorten --shared-prefix "
                                                         "(at most 152 here)"),
    (["--prompt-tokens", "8,300"], "shorten --prompt-tokens (at most 160 here)"),
    (["--shared-prefix", "250", "--prompt-tokens", "250"], "shorten --shared-prefix and --prompt-tokens and --gen"),
])
def test_the_flag_that_asks_for_the_context_is_named(tiny, args, says):
    r = runner.invoke(app, ["bench", "--model", tiny, "--runs", "1", "--no-floor", *args])
    one_line_error(r, says)
