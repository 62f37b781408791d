// The OpenAI-compatible API as the page uses it: the key from localStorage, errors as readable
// messages, and chat streams that resume (GET /v1/streams/{id} with Last-Event-ID) after a dropped
// connection.

const KEY_STORAGE = "llmserve.apiKey";
const MAX_RESUME_ATTEMPTS = 40;

export function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

function headers(extra = {}) {
  const key = apiKey();
  return { ...(key ? { Authorization: `Bearer ${key}` } : {}), ...extra };
}

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function errorOf(response) {
  let message = response.statusText;
  let code = null;
  try {
    const body = await response.json();
    message = body.error?.message ?? message;
    code = body.error?.code ?? null;
  } catch { /* not JSON */ }
  const retry = response.headers.get("retry-after");
  if (response.status === 401) {
    return new ApiError(401, "401 Unauthorized: this server needs a valid API key. Enter it in the Key field.", code);
  }
  if (response.status === 429 && code === "insufficient_quota") {
    return new ApiError(429, `429 Quota used up: ${message}`, code);
  }
  if (response.status === 429) {
    const wait = retry ? ` Try again in ${retry} s.` : "";
    return new ApiError(429, `429 Too many requests: your key's rate limit is reached.${wait}`, code);
  }
  if (response.status === 503) {
    const wait = retry ? ` Retry in ${retry} s.` : "";
    return new ApiError(503, `503 The server is busy or still loading the model.${wait} (${message})`, code);
  }
  return new ApiError(response.status, `${response.status}: ${message}`, code);
}

export async function call(method, path, body) {
  const response = await fetch(path, {
    method,
    headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }),
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

// Reads a response's server-sent events, calling onEvent({id, data}) for each.
async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let id = null;
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("id:")) id = Number(line.slice(3).trim());
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      }
      if (data.length) onEvent({ id, data: data.join("\n") });
    }
  }
}

function pause(ms, signal) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => { clearTimeout(timer); reject(signal.reason); }, { once: true });
  });
}

// Streams a chat completion (asked for as resumable), calling onChunk(chunk) for each chunk in order.
// A connection that drops (or ends before [DONE]) is picked up where it stopped, with no chunk seen
// twice; onReconnecting(attempt) and onResumed() say so. `signal` aborts the fetch (the caller also
// DELETEs the stream to stop the generation). Returns the stream's id.
export async function streamChat(body, { signal, onStart, onChunk, onReconnecting, onResumed }) {
  let response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: headers({ "Content-Type": "application/json" }),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true, resumable: true } }),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  const streamId = response.headers.get("x-stream-id");
  onStart?.(streamId);
  let lastId = -1;
  let finished = false;
  const onEvent = ({ id, data }) => {
    if (id !== null) {
      if (id <= lastId) return; // already seen (never expected: the server resumes after lastId)
      lastId = id;
    }
    if (data === "[DONE]") finished = true;
    else onChunk(JSON.parse(data));
  };
  for (let attempt = 0; ;) {
    if (response) {
      try {
        await readEvents(response, onEvent);
      } catch (error) {
        if (signal.aborted) throw error;
      }
      if (finished) return streamId;
    }
    if (!streamId || ++attempt > MAX_RESUME_ATTEMPTS) throw new ApiError(0, "The connection was lost and the answer could not be resumed.");
    onReconnecting?.(attempt);
    await pause(Math.min(200 * attempt, 2000), signal);
    try {
      response = await fetch(`/v1/streams/${encodeURIComponent(streamId)}`, {
        headers: headers({ "Last-Event-ID": String(lastId) }),
        signal,
      });
    } catch (error) {
      if (signal.aborted) throw error;
      response = null;
      continue;
    }
    if (!response.ok) throw await errorOf(response);
    onResumed?.();
  }
}

export async function cancelStream(streamId) {
  try {
    await fetch(`/v1/streams/${encodeURIComponent(streamId)}`, { method: "DELETE", headers: headers() });
  } catch { /* the stream ends on the server anyway once its grace period is over */ }
}
