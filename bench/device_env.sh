# Source at the start of a command on the GPU machine (device tool): installs the wheels that its
# image lacks (pydantic, carried in .whl/) and numwatch itself, editable, without network.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
export PYTHONUNBUFFERED=1
set +e
