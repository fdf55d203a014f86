"""The native engine: our model runner, paged attention, CPU kernels and sampling."""
