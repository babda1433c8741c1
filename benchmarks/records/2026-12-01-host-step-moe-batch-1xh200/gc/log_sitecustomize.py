import gc, os, time, json
_f = "/tmp/gclog-%d.jsonl" % os.getpid()
_t = {}
def _cb(phase, info):
    if phase == "start":
        _t["s"] = time.perf_counter()
    else:
        with open(_f, "a") as fh:
            fh.write(json.dumps({"t": time.time(), "gen": info["generation"],
                                 "ms": round((time.perf_counter() - _t.get("s", 0)) * 1e3, 3),
                                 "collected": info["collected"]}) + "\n")
gc.callbacks.append(_cb)
