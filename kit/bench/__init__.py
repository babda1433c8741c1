"""The benchmark: a matrix of training configurations run side by side in one invocation
(`python -m kit.bench MATRIX`, kit.bench.runner), its ranks (worker), the article recipe as a
baseline (article), and its tables (report). Also the harness every experiment on ranks runs on
(experiment: the benchmark's worker, and the notebooks' experiments in kit/lab)."""
