// The Python module torch's extension loader imports. It holds nothing: the operators register
// themselves with the dispatcher (TORCH_LIBRARY in each source) and are called as
// torch.ops.tokenfleet.*. Written against Python.h alone because torch/extension.h (pybind11 and
// torch's C++ API) took ~35 s to compile per source on a 2-vCPU host, most of a cold build.
#include <Python.h>

#define TOKENFLEET_CONCAT_(a, b) a##b
#define TOKENFLEET_CONCAT(a, b) TOKENFLEET_CONCAT_(a, b)
#define TOKENFLEET_STR_(a) #a
#define TOKENFLEET_STR(a) TOKENFLEET_STR_(a)

static struct PyModuleDef tokenfleet_module = {
    PyModuleDef_HEAD_INIT, TOKENFLEET_STR(TORCH_EXTENSION_NAME), nullptr, -1, nullptr,
    nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC TOKENFLEET_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&tokenfleet_module); }
