// Unit tests of the plugin's logic: `npm test` (node's built-in runner).
import { test } from "node:test";
import assert from "node:assert/strict";

import { admissionHandler, problemWith } from "./plugin.js";

function request(object, extra = {}) {
  return {
    uid: "u1",
    kind: { group: "", version: "v1", kind: object.kind },
    resource: { group: "", version: "v1", resource: "pods" },
    subResource: undefined,
    name: object.metadata?.name ?? "",
    namespace: object.metadata?.namespace,
    operation: "create",
    userInfo: { username: "ana", uid: "", groups: [], extra: [] },
    object: JSON.stringify(object),
    oldObject: undefined,
    dryRun: false,
    configuration: "{}",
    ...extra,
  };
}

const pod = (images) => ({
  apiVersion: "v1",
  kind: "Pod",
  metadata: { name: "web", namespace: "prod" },
  spec: { containers: images.map((image, i) => ({ name: `c${i}`, image })) },
});

test("tags are read after the last slash, past any registry port", () => {
  assert.equal(problemWith("nginx:1.27"), null);
  assert.equal(problemWith("nginx"), "has no tag, so it means :latest");
  assert.equal(problemWith("nginx:latest"), "is tagged :latest");
  assert.equal(problemWith("registry:5000/team/api"), "has no tag, so it means :latest");
  assert.equal(problemWith("registry:5000/team/api:2"), null);
  assert.equal(problemWith("nginx:latest@sha256:0123"), null, "a digest pins the image");
});

test("denies a pod with an untagged or :latest image, naming each", () => {
  const answer = admissionHandler.admit(request(pod(["nginx:1.27", "redis", "busybox:latest"])));
  assert.equal(answer.allowed, false);
  assert.equal(answer.status.code, 403);
  assert.equal(
    answer.status.message,
    'Pod web: container "c1" image "redis" has no tag, so it means :latest; ' +
      'container "c2" image "busybox:latest" is tagged :latest; pin a version tag or a digest',
  );
});

test("allows pinned pods, deletes, and exempt namespaces", () => {
  assert.equal(admissionHandler.admit(request(pod(["nginx:1.27"]))).allowed, true);
  assert.equal(admissionHandler.admit(request(pod(["nginx"]), { object: undefined })).allowed, true);
  const exempt = request(pod(["nginx"]), { configuration: '{"exemptNamespaces": ["prod"]}' });
  assert.equal(admissionHandler.admit(exempt).allowed, true);
});

test("looks into the pod templates of workloads", () => {
  const deployment = {
    apiVersion: "apps/v1",
    kind: "Deployment",
    metadata: { name: "api" },
    spec: { template: { spec: { initContainers: [{ name: "init", image: "alpine" }], containers: [] } } },
  };
  const answer = admissionHandler.admit(request(deployment));
  assert.match(answer.status.message, /^Deployment api: container "init" image "alpine" has no tag/);
});

test("configuration errors are thrown as the WIT err", () => {
  assert.doesNotThrow(() => admissionHandler.validateConfiguration("{}"));
  assert.throws(() => admissionHandler.validateConfiguration('{"exempt": []}'), /unknown field "exempt"/);
  assert.throws(() => admissionHandler.validateConfiguration('{"exemptNamespaces": "dev"}'), /list of namespace/);
});

test("a configuration that slipped through is answered, not thrown", () => {
  const answer = admissionHandler.admit(request(pod(["nginx"]), { configuration: "[]" }));
  assert.deepEqual([answer.allowed, answer.status.code], [false, 500]);
  assert.match(answer.status.message, /must be a JSON object/);
});
