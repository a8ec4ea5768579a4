"""The engine's own CPU kernels and the choices around them: ISA level, kernel paths, the C++ build, GEMMs."""
