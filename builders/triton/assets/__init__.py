"""Source files that harp-trt copies into Triton model repositories: the Python-backend models
(``preprocessing.py``, ``postprocessing.py`` -> ``<model>/1/model.py``) and the clients
(``ort_client.py``, ``trtllm_client.py`` -> ``client.py``). They import nothing from harp_trt, so a
repository runs without it; their pure helpers are importable here for tests."""
