{{/* Names, labels and the operator's RBAC rules, shared by the templates. */}}

{{- define "kvpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvpool.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvpool.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvpool.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvpool
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvpool.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvpool.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The operator pods' selector labels as K=V,K=V (what pools' NetworkPolicies admit). */}}
{{- define "kvpool.selectorLabelsFlag" -}}
{{- $pairs := list -}}
{{- range $k, $v := (include "kvpool.selectorLabels" . | fromYaml) -}}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{/* The `kvpool operator` command line, one argument per list item. */}}
{{- define "kvpool.operatorArgs" -}}
- operator
{{- if include "kvpool.clusterwide" . }}
- --all-namespaces
{{- else }}
{{- range (include "kvpool.watchNamespaces" . | fromJsonArray) }}
- --namespace={{ . }}
{{- end }}
{{- end }}
{{- if .Values.operator.peering.enabled }}
- --peering={{ .Values.operator.peering.name }}
{{- else }}
- --standalone
{{- end }}
- --liveness=http://0.0.0.0:{{ .Values.operator.healthPort }}/healthz
- --timer-interval={{ .Values.operator.timerInterval }}
- --operator-pod-labels={{ include "kvpool.selectorLabelsFlag" . }}
{{- range .Values.operator.allowedImagePrefixes }}
- {{ printf "--allowed-image-prefix=%s" . | quote }}
{{- end }}
{{- if .Values.operator.allowForeignHandoffPeers }}
- --allow-foreign-handoff-peers
{{- end }}
{{- if .Values.operator.allowNodeSockets }}
- --allow-node-sockets
{{- end }}
{{- if .Values.operator.verbose }}
- --verbose
{{- end }}
{{- range .Values.operator.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* "true" when the operator serves every namespace (operator.clusterWide), else empty. */}}
{{- define "kvpool.clusterwide" -}}
{{- if .Values.operator.clusterWide -}}
{{- if .Values.operator.watchNamespaces -}}
{{- fail "operator.clusterWide=true serves every namespace: leave operator.watchNamespaces empty" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* The namespaces served when not cluster-wide, as a JSON list: operator.watchNamespaces,
or the release's namespace alone when that is empty (the default). */}}
{{- define "kvpool.watchNamespaces" -}}
{{- if .Values.operator.watchNamespaces -}}
{{- toJson .Values.operator.watchNamespaces -}}
{{- else -}}
{{- list .Release.Namespace | toJson -}}
{{- end -}}
{{- end -}}

{{/*
Rules the operator needs in every namespace it serves (a ClusterRole when it serves all of
them). Each rule names the code that needs it.
*/}}
{{- define "kvpool.namespacedRules" -}}
# kopf watches pools and patches their finalizer/annotations; the operator writes status
# and moves spec.replicas through /scale (built-in autoscaler).
- apiGroups: ["kvpool.io"]
  resources: ["kvcachepools"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["kvpool.io"]
  resources: ["kvcachepools/status", "kvcachepools/scale"]
  verbs: ["get", "patch"]
# Children carry ownerReferences with blockOwnerDeletion, which clusters running the
# OwnerReferencesPermissionEnforcement admission plugin allow only with this.
- apiGroups: ["kvpool.io"]
  resources: ["kvcachepools/finalizers"]
  verbs: ["update"]
# Children: read, then server-side apply (create when absent, patch otherwise). Owner
# references garbage-collect them with the pool.
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["get", "create", "patch"]
# Credentials: <pool>-auth and <pool>-tenant-<name>, read first so tokens are generated once
# and kept; the tenants' own Secrets (secretName) are read by name. Delete: the generated
# Secret of a tenant removed from the pool (a re-added tenant gets a new token). No list or
# watch: the operator reads Secrets only by the names its pools give.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "patch", "delete"]
# The pools' NetworkPolicies; delete when a pool turns spec.network.policy off.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch"]
{{- if .Values.rbac.serviceMonitors }}
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors"]
  verbs: ["get", "create", "patch"]
{{- end }}
# Agent pods: their IPs, to scrape /metrics for status and autoscaling.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list"]
# Events about pools (the operator's and kopf's).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if and .Values.operator.peering.enabled (not (include "kvpool.clusterwide" .)) }}
# kopf peering, one KopfPeering per served namespace.
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["list", "watch"]
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  resourceNames: [{{ .Values.operator.peering.name | quote }}]
  verbs: ["get", "patch"]
{{- end }}
{{- end -}}
