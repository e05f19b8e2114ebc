// Validates ServiceMonitor objects against the prometheus-operator CRD schema, as compiled
// by the npm package @kubernetes-models/prometheus-operator.
//   node servicemonitor_crd_check.mjs NODE_PREFIX DOCS.json
// NODE_PREFIX: the folder where that package was installed (npm install --prefix NODE_PREFIX).
// DOCS.json: a JSON list of ServiceMonitor objects. Exit 1 on any invalid object.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [prefix, docsPath] = process.argv.slice(2);
if (!prefix || !docsPath) {
  console.error("usage: node servicemonitor_crd_check.mjs NODE_PREFIX DOCS.json");
  process.exit(2);
}
const modPath = join(prefix, "node_modules", "@kubernetes-models", "prometheus-operator",
  "monitoring.coreos.com", "v1", "ServiceMonitor.js");
const { ServiceMonitor } = await import(pathToFileURL(modPath).href);
const docs = JSON.parse(readFileSync(docsPath, "utf8"));
if (!Array.isArray(docs) || docs.length === 0) {
  console.error("ERROR no ServiceMonitor to validate");
  process.exit(1);
}
let failed = 0;
for (const doc of docs) {
  const name = doc?.metadata?.name ?? "?";
  try {
    new ServiceMonitor(doc).validate();
    console.log(`ok: ServiceMonitor/${name} matches the monitoring.coreos.com/v1 CRD schema`);
  } catch (e) {
    failed++;
    console.log(`ERROR ServiceMonitor/${name}: ${e.message}`);
  }
}
process.exit(failed ? 1 : 0);
