"""Stack unwinding: CFI interpreter, frame-pointer and prologue fallbacks, the stack walker."""
