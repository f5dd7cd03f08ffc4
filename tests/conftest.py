import jax

# References are float64; float32 cases ask for float32 explicitly. The x64-off path is
# covered in a subprocess (tests/test_linear.py::test_x64_disabled).
jax.config.update("jax_enable_x64", True)
# Test sizes are tiny, so compiling is most of the suite's time: compile fast (the
# benchmarks measure the optimised programs; test_examples.py runs scripts likewise).
jax.config.update("jax_disable_most_optimizations", True)
