# Sourced by the device scripts: the cp312 wheels carried in .whl/ go to /tmp/site (on PYTHONPATH), then the
# repository's packages named in LLMC_PACKAGES (default: engine, cpu and cuda backends) install editable.
# Expects PY (the Python to use).
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# shellcheck disable=SC2086  (a list of -e options)
$PY -m pip install -q --no-deps --no-build-isolation --no-compile ${LLMC_PACKAGES:--e . -e backends/cpu -e backends/cuda} \
  2>&1 | tail -2
