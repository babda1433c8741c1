import gc
gc.disable()
open("/tmp/gcoff-marker", "a").write("x\n")
