// Settings form values -> chat-completion request fields (blank fields use the server's defaults).

const NUMBER_FIELDS = {
  temperature: { integer: false },
  top_p: { integer: false },
  top_k: { integer: true },
  max_tokens: { integer: true },
  seed: { integer: true },
};

/** A setting that cannot be sent; the message names the field and the value. */
export class SettingsError extends Error {}

function parseNumber(name, raw, integer) {
  const value = Number(raw);
  if (!Number.isFinite(value)) throw new SettingsError(`${name}: ${JSON.stringify(raw)} is not a number`);
  if (integer && !Number.isInteger(value)) throw new SettingsError(`${name}: ${raw} is not a whole number`);
  return value;
}

function parseStops(raw) {
  return raw
    .split("\n")
    .filter((line) => line.length > 0)
    .map((line) => line.replace(/\\n/g, "\n").replace(/\\t/g, "\t"));
}

function responseFormat(raw) {
  let schema;
  try {
    schema = JSON.parse(raw);
  } catch (err) {
    throw new SettingsError(`JSON schema: not valid JSON (${err.message})`);
  }
  if (schema === null || typeof schema !== "object" || Array.isArray(schema)) {
    throw new SettingsError("JSON schema: must be a JSON object");
  }
  // Accept either a bare schema or OpenAI's {name, schema, strict} wrapper.
  const wrapped = typeof schema.name === "string" && typeof schema.schema === "object";
  return { type: "json_schema", json_schema: wrapped ? schema : { name: "playground", schema, strict: true } };
}

/** Request fields from the settings (strings as typed); throws SettingsError. */
export function requestFields(settings) {
  const fields = {};
  for (const [name, { integer }] of Object.entries(NUMBER_FIELDS)) {
    const raw = String(settings[name] ?? "").trim();
    if (raw !== "") fields[name] = parseNumber(name, raw, integer);
  }
  const stops = parseStops(String(settings.stop ?? ""));
  if (stops.length) fields.stop = stops;
  const schema = String(settings.json_schema ?? "").trim();
  if (schema !== "") fields.response_format = responseFormat(schema);
  return fields;
}

/** Put saved settings into the form's inputs (by name). */
export function fillSettingsForm(form, settings) {
  for (const input of form.elements) {
    if (!input.name) continue;
    if (input.type === "checkbox") input.checked = Boolean(settings[input.name]);
    else input.value = settings[input.name] ?? "";
  }
}
