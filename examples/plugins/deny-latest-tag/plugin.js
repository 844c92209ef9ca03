// deny-latest-tag: a validating Trellis plugin that refuses container images tagged
// `:latest` or not tagged at all (which pulls `:latest`), because such a Pod runs
// whatever the registry serves on the day it starts. Images pinned by digest
// (`name@sha256:...`) are allowed whatever their tag.
//
// It checks Pods and the Pod templates of Deployments, ReplicaSets, StatefulSets,
// DaemonSets, Jobs and CronJobs; which of them reach it is up to the Plugin's rules.
//
// Configuration (optional): {"exemptNamespaces": ["dev"]}.
//
// The module exports `admissionHandler`, the `admission-handler` interface of the
// WIT world `admission`; componentize-js maps WIT names to camelCase. It imports
// nothing, so `node --test` can load it as is.

const CONTAINER_LISTS = ["initContainers", "containers", "ephemeralContainers"];

function parseConfiguration(text) {
  const config = JSON.parse(text || "{}");
  if (config === null || typeof config !== "object" || Array.isArray(config)) {
    throw "configuration must be a JSON object";
  }
  for (const key of Object.keys(config)) {
    if (key !== "exemptNamespaces") {
      throw `configuration: unknown field "${key}", expected "exemptNamespaces"`;
    }
  }
  const exempt = config.exemptNamespaces ?? [];
  if (!Array.isArray(exempt) || exempt.some((ns) => typeof ns !== "string")) {
    throw "configuration: exemptNamespaces must be a list of namespace names";
  }
  return { exemptNamespaces: exempt };
}

// The Pod spec inside an object of a workload kind, or undefined.
export function podSpecOf(object) {
  switch (object?.kind) {
    case "Pod":
      return object.spec;
    case "CronJob":
      return object.spec?.jobTemplate?.spec?.template?.spec;
    case "PodTemplate":
      return object.template?.spec;
    case "Deployment":
    case "ReplicaSet":
    case "StatefulSet":
    case "DaemonSet":
    case "Job":
    case "ReplicationController":
      return object.spec?.template?.spec;
    default:
      return undefined;
  }
}

// Why `image` is refused, or null when it is fine.
export function problemWith(image) {
  if (typeof image !== "string" || image === "") return null; // the API server rejects these itself
  if (image.includes("@")) return null; // pinned by digest
  const lastSlash = image.lastIndexOf("/");
  const colon = image.indexOf(":", lastSlash + 1); // a colon before the last slash is a registry port
  if (colon < 0) return "has no tag, so it means :latest";
  if (image.slice(colon + 1) === "latest") return "is tagged :latest";
  return null;
}

export function problemsIn(object) {
  const spec = podSpecOf(object);
  const problems = [];
  for (const list of CONTAINER_LISTS) {
    for (const container of spec?.[list] ?? []) {
      const problem = problemWith(container.image);
      if (problem) problems.push(`container "${container.name}" image "${container.image}" ${problem}`);
    }
  }
  return problems;
}

function allow() {
  return { allowed: true, status: undefined, warnings: [], patch: undefined };
}

function deny(code, reason, message) {
  return { allowed: false, status: { code, reason, message }, warnings: [], patch: undefined };
}

export const admissionHandler = {
  validateConfiguration(configuration) {
    parseConfiguration(configuration);
  },

  admit(request) {
    let config;
    try {
      config = parseConfiguration(request.configuration);
    } catch (e) {
      // The host checks the configuration before it serves; answer rather than
      // trap should one slip through.
      return deny(500, "InternalError", String(e));
    }
    if (request.object === undefined || request.object === null) return allow();
    if (config.exemptNamespaces.includes(request.namespace ?? "")) return allow();
    const object = JSON.parse(request.object);
    const problems = problemsIn(object);
    if (problems.length === 0) return allow();
    const name = request.name || `${object.metadata?.generateName ?? ""}*`;
    return deny(403, "Forbidden", `${object.kind} ${name}: ${problems.join("; ")}; pin a version tag or a digest`);
  },
};
