"""The dispatch rule shared by every op: defaults per platform, fallback, errors."""

import pytest

from pallas_kernels import dispatch


def _versions(log):
  def pallas(x):
    log.append("pallas")
    if x < 0:
      raise NotImplementedError("pallas: negative inputs are not tiled")
    return "pallas"

  def xla(x):
    log.append("xla")
    return "xla"

  return {"xla": xla, "pallas": pallas}


def test_none_on_cpu_is_xla(monkeypatch):
  monkeypatch.setattr(dispatch, "on_gpu", lambda: False)
  log = []
  assert dispatch.resolve("op", None, _versions(log))(1) == "xla"
  assert log == ["xla"]


def test_none_on_gpu_prefers_pallas_and_falls_back_on_not_implemented(monkeypatch):
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  log = []
  version = dispatch.resolve("op", None, _versions(log))
  assert version(1) == "pallas"
  assert version(-1) == "xla"
  assert log == ["pallas", "pallas", "xla"]


def test_named_version_never_falls_back(monkeypatch):
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  with pytest.raises(NotImplementedError, match="negative"):
    dispatch.resolve("op", "pallas", _versions([]))(-1)


def test_unknown_and_missing_names():
  with pytest.raises(ValueError, match="unknown"):
    dispatch.resolve("op", "cuda", _versions([]))
  with pytest.raises(NotImplementedError, match="does not exist yet"):
    dispatch.resolve("op", "triton", _versions([]))
