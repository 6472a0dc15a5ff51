"""Front ends over a backend: the OpenAI-compatible HTTP server, Prometheus metrics, and the Triton Inference Server (tritonserver_*) model and repository writer."""
