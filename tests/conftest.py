import jax

# References are float64; float32 cases ask for float32 explicitly. The x64-off path is
# covered in a subprocess (tests/test_linear.py::test_x64_disabled).
jax.config.update("jax_enable_x64", True)
