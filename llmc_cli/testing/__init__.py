"""The conformance kit: the kernel cases every llmc backend must pass, their fixtures, and the float64 PyTorch
reference they are checked against. A third-party backend runs it against its own plugin:

    pip install torch pytest               # the test-only oracle and runner (llmc itself never imports torch)
    pytest --pyargs llmc_cli.testing       # every installed backend (entry-point group llmc.backends)
    LLMC_TEST_BACKENDS=metal pytest --pyargs llmc_cli.testing
    LLMC_TEST_PLUGIN=my_pkg:MetalPlugin pytest --pyargs llmc_cli.testing   # a plugin that is not installed

See docs/writing-a-backend.md. `helpers` (no torch) holds the device and tolerance helpers for anyone's tests.
"""
