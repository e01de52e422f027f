"""Tools for the tests and benchmarks of torch_serialized; the library never imports them."""
