// quill's public HTTP API from the browser: models, stats, and streamed chat (SSE over fetch).

/** An API failure with a message meant for people (status 0: the server could not be reached). */
export class ApiError extends Error {
  constructor(message, status = 0, code = null) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
  }
}

let apiKey = "";

/** The key for servers started with --api-key ("" for none), sent as a Bearer token. */
export function setApiKey(key) {
  apiKey = String(key || "").trim();
}

function withAuth(headers) {
  return apiKey ? { ...headers, Authorization: `Bearer ${apiKey}` } : headers;
}

async function errorFromResponse(response) {
  let message = response.statusText || "request failed";
  let code = null;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || null;
    }
  } catch (_) {
    // not JSON: keep the status text
  }
  const retry = response.headers.get("Retry-After");
  const suffix = response.status === 503 && retry ? ` (retry after ${retry} s)` : "";
  return new ApiError(`HTTP ${response.status}: ${message}${suffix}`, response.status, code);
}

async function send(url, init) {
  try {
    return await fetch(url, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(`could not reach the server at ${location.origin}: ${err.message}`);
  }
}

export async function getJSON(url) {
  const response = await send(url, { headers: withAuth({ Accept: "application/json" }) });
  if (!response.ok) throw await errorFromResponse(response);
  return response.json();
}

/** Yield each SSE event's data string from a fetch Response body. */
export async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
        const data = dataOf(event);
        if (data !== null) yield data;
      }
    }
    const tail = dataOf(buffer + decoder.decode());
    if (tail !== null) yield tail;
  } finally {
    reader.releaseLock();
  }
}

function dataOf(event) {
  const lines = event.split(/\r?\n/).filter((l) => l.startsWith("data:"));
  if (lines.length === 0) return null;
  return lines.map((l) => l.slice(5).replace(/^ /, "")).join("\n");
}

/**
 * POST a streamed chat completion; calls onChunk(chunk, arrivalMs) for every JSON chunk,
 * arrivalMs measured from just before the request was sent. Resolves when [DONE] arrives
 * or the stream ends; rejects with ApiError (HTTP or mid-stream error) or AbortError.
 */
export async function streamChat(body, signal, onChunk) {
  const t0 = performance.now();
  const response = await send("/v1/chat/completions", {
    method: "POST",
    headers: withAuth({ "Content-Type": "application/json", Accept: "text/event-stream" }),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!response.ok) throw await errorFromResponse(response);
  for await (const data of sseData(response)) {
    if (data.trim() === "[DONE]") return { done: true };
    let chunk;
    try {
      chunk = JSON.parse(data);
    } catch (_) {
      throw new ApiError(`the server sent an event that is not JSON: ${data.slice(0, 80)}`);
    }
    if (chunk.error) {
      const e = chunk.error;
      throw new ApiError(`stream error: ${e.message || JSON.stringify(e)}`, 0, e.code || null);
    }
    onChunk(chunk, performance.now() - t0);
  }
  return { done: false };
}
