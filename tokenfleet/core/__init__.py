"""The engine core: admission, sequences and the native scheduler, behind one interface; no Redis."""
