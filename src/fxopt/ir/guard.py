"""The input guard's name, for the modules that must recognize the guard without importing
what defines it (a leaf: no imports). The guard itself is
:class:`fxopt.ir.contract.InputGuard`, the first call of an optimized graph."""

#: Node name and submodule name of the input guard of an optimized graph.
GUARD_NAME = "_fxopt_input_guard"
