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
  assert dispatch.resolve("op", None, _versions(log), gpu_default=("pallas", "xla"))(1) == "xla"
  assert log == ["xla"]


def test_none_on_gpu_prefers_pallas_and_falls_back_on_not_implemented(monkeypatch):
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  log = []
  version = dispatch.resolve("op", None, _versions(log), gpu_default=("pallas", "xla"))
  assert version(1) == "pallas"
  assert version(-1) == "xla"
  assert log == ["pallas", "pallas", "xla"]


def test_named_version_never_falls_back(monkeypatch):
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  with pytest.raises(NotImplementedError, match="negative"):
    dispatch.resolve("op", "pallas", _versions([]), gpu_default=("pallas", "xla"))(-1)


def test_gpu_default_is_the_ops_own_order(monkeypatch):
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  log = []
  assert dispatch.resolve("op", None, _versions(log), gpu_default=("xla",))(1) == "xla"
  assert log == ["xla"]


def test_unknown_and_missing_names():
  # "triton" names no version of any op (every GPU kernel here is Pallas), so it is unknown.
  for name in ("cuda", "triton"):
    with pytest.raises(ValueError, match="unknown"):
      dispatch.resolve("op", name, _versions([]), gpu_default=("xla",))
  with pytest.raises(NotImplementedError, match="does not exist for this op"):
    dispatch.resolve("op", "cudnn", _versions([]), gpu_default=("xla",))
