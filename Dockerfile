# The outboxkit relay (and CLI) as a container image, for docker-compose.yml.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY outbox ./outbox
COPY relay ./relay
COPY consumers ./consumers
COPY dedup ./dedup
RUN pip install --no-cache-dir '.[fast]'
USER nobody
EXPOSE 9108
HEALTHCHECK --interval=5s --timeout=3s --retries=10 \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:9108/readyz').status != 200)"
ENTRYPOINT ["outbox"]
CMD ["relay", "--http-host", "0.0.0.0", "--http-port", "9108"]
