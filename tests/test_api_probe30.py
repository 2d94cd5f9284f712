"""A probe of the docs (session 30): after one load(pin=False) from a thread the app had limited
to core 1, every later load warned that the profile was measured on cores [0, 1] but the process
may run on [1], though the app had given it both cores back."""
from gguf import GGMLQuantizationType as QT

import edgellm
import edgellm.api as api
from tests.synthetic import write_tiny_model


def test_a_load_that_pins_nothing_does_not_stand_for_the_process_cores(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    path = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.F32, seed=1).path
    monkeypatch.setattr(api, "_FIRST_AFFINITY", [])
    import edgellm.device.topology as topology

    cores = [frozenset({1})]                                  # the app's choice at the first load
    monkeypatch.setattr(topology, "current_affinity", lambda: cores[0])
    seen = []
    monkeypatch.setattr(api, "_warn_if_measured_elsewhere", lambda profile, affinity: seen.append(affinity))
    edgellm.load(path, n_ctx=64, threads=1, pin=False).close()
    cores[0] = frozenset({0, 1})                              # given both cores back
    edgellm.load(path, n_ctx=64, threads=1).close()
    assert seen == [frozenset({1}), frozenset({0, 1})]
