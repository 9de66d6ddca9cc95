// The header's server side: the served model's name, and gauges refreshed about once a second.

import { getJSON } from "./api.js";
import { renderServerGauges } from "./view.js";

/** Show the model in `modelEl` and keep `gaugesEl` fresh; onModel(id) gets the model id. */
export function watchServer(modelEl, gaugesEl, onModel) {
  async function loadModel() {
    try {
      const models = await getJSON("/v1/models");
      const card = models.data && models.data[0];
      onModel(card ? card.id : null);
      modelEl.textContent = card ? `${card.id}${card.max_model_len ? ` · ${card.max_model_len} ctx` : ""}` : "no model";
    } catch (err) {
      modelEl.textContent = "model unavailable";
      modelEl.title = err.message;
      setTimeout(loadModel, 2000);
    }
  }

  let polling = false;
  async function pollStats() {
    if (polling || document.hidden) return;
    polling = true;
    try {
      renderServerGauges(gaugesEl, await getJSON("/v1/stats"), null);
    } catch (err) {
      renderServerGauges(gaugesEl, null, err);
    } finally {
      polling = false;
    }
  }

  loadModel();
  pollStats();
  setInterval(pollStats, 1000);
}
